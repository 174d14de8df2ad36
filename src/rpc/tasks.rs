//! Async tasks (the function-sharing seed): a named function started in the
//! background, polled by id for its status and result, cancellable. Finished
//! results are kept for a configurable time, then dropped; the number of
//! tasks held at once is bounded.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::error::Status;
use crate::pipeline::budget::{MemoryBudget, Reservation};
use crate::rpc::call::Cancellation;
use crate::rpc::call::{Call, Output};
use crate::rpc::function::Function;
use crate::util::sync::lock;

/// Task retention settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskConfig {
    /// How long a finished task's result is kept (default 5 minutes).
    pub ttl: Duration,
    /// Most tasks held at once, running or finished (default 10,000).
    pub max_tasks: usize,
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self { ttl: Duration::from_secs(300), max_tasks: 10_000 }
    }
}

/// Where a task is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskState {
    /// Accepted, not started.
    Pending,
    /// Running.
    Running,
    /// Finished; the result is waiting.
    Done,
    /// Failed with this message.
    Failed(String),
    /// Cancelled before it finished.
    Cancelled,
}

impl TaskState {
    /// True for Done, Failed and Cancelled.
    pub fn is_finished(&self) -> bool {
        matches!(self, TaskState::Done | TaskState::Failed(_) | TaskState::Cancelled)
    }
}

struct Entry {
    state: TaskState,
    result: Option<Result<Output, Status>>,
    finished_at: Option<Instant>,
    cancel: Cancellation,
    abort: Option<tokio::task::AbortHandle>,
    done: watch::Receiver<bool>,
    /// The result's bytes, held against the memory budget until it expires.
    _held: Option<Reservation>,
}

/// The server's tasks.
pub(crate) struct TaskManager {
    config: TaskConfig,
    tasks: Arc<Mutex<HashMap<String, Entry>>>,
    budget: MemoryBudget,
}

impl TaskManager {
    pub(crate) fn new(config: TaskConfig, budget: MemoryBudget) -> Self {
        Self { config, tasks: Arc::new(Mutex::new(HashMap::new())), budget }
    }

    /// Drops finished tasks older than the ttl.
    pub(crate) fn sweep(&self) {
        let ttl = self.config.ttl;
        lock(&self.tasks).retain(|_, e| e.finished_at.is_none_or(|t| t.elapsed() < ttl));
    }

    /// Starts `f` on `call` in the background; returns the task id.
    pub(crate) fn submit(&self, f: Arc<Function>, mut call: Call) -> Result<String, Status> {
        self.sweep();
        let id = format!("task-{:016x}", rand::random::<u64>());
        let cancel = Cancellation::default();
        call.ctx.cancel = cancel.clone();
        // The caller's deadline bounds its submit call, not the task, and
        // the task does not hold the submit's place on its connection.
        call.ctx.deadline = None;
        call.ctx.held = None;
        let (done_tx, done_rx) = watch::channel(false);
        {
            let mut map = lock(&self.tasks);
            if map.len() >= self.config.max_tasks {
                return Err(Status::resource_exhausted(format!(
                    "{} tasks are held (running or unexpired); wait for results to expire or raise max_tasks",
                    map.len()
                )));
            }
            map.insert(
                id.clone(),
                Entry {
                    state: TaskState::Pending,
                    result: None,
                    finished_at: None,
                    cancel,
                    abort: None,
                    done: done_rx,
                    _held: None,
                },
            );
        }
        let tasks = self.tasks.clone();
        let budget = self.budget.clone();
        let tid = id.clone();
        let handle = tokio::spawn(async move {
            if let Some(e) = lock(&tasks).get_mut(&tid) {
                e.state = TaskState::Running;
            }
            let r = f.run(call).await;
            // A result waits for its caller for up to the ttl: its bytes are
            // held against the budget, or the task fails instead of keeping it.
            let (r, held) = match r {
                Ok(out) => {
                    let n: u64 = out.tensors.iter().map(|t| t.nbytes() as u64).sum();
                    match budget.try_reserve(n, "task result") {
                        Ok(h) => (Ok(out), Some(h)),
                        Err(e) => (Err(Status::resource_exhausted(e.to_string())), None),
                    }
                }
                Err(s) => (Err(s), None),
            };
            if let Some(e) = lock(&tasks).get_mut(&tid)
                && e.state != TaskState::Cancelled
            {
                e.state = match &r {
                    Ok(_) => TaskState::Done,
                    Err(s) => TaskState::Failed(s.to_string()),
                };
                e.result = Some(r);
                e._held = held;
                e.finished_at = Some(Instant::now());
            }
            let _ = done_tx.send(true);
        });
        if let Some(e) = lock(&self.tasks).get_mut(&id) {
            e.abort = Some(handle.abort_handle());
        }
        Ok(id)
    }

    fn missing(id: &str) -> Status {
        Status::not_found(format!("no task {id:?}: unknown id, or its result expired"))
    }

    pub(crate) fn status(&self, id: &str) -> Result<TaskState, Status> {
        self.sweep();
        lock(&self.tasks).get(id).map(|e| e.state.clone()).ok_or_else(|| Self::missing(id))
    }

    /// The result, waiting up to `wait` for the task to finish.
    pub(crate) async fn result(&self, id: &str, wait: Duration) -> Result<Output, Status> {
        let mut done = lock(&self.tasks).get(id).map(|e| e.done.clone()).ok_or_else(|| Self::missing(id))?;
        if !wait.is_zero() {
            let _ = tokio::time::timeout(wait, done.wait_for(|d| *d)).await;
        }
        let map = lock(&self.tasks);
        let e = map.get(id).ok_or_else(|| Self::missing(id))?;
        match (&e.state, &e.result) {
            (TaskState::Cancelled, _) => Err(Status::cancelled(format!("task {id} was cancelled"))),
            (_, Some(r)) => r.clone(),
            (state, None) => Err(Status::failed_precondition(format!("task {id} has not finished ({state:?})"))),
        }
    }

    /// Cancels a task that has not finished; returns its state afterwards.
    pub(crate) fn cancel(&self, id: &str) -> Result<TaskState, Status> {
        let mut map = lock(&self.tasks);
        let e = map.get_mut(id).ok_or_else(|| Self::missing(id))?;
        if !e.state.is_finished() {
            e.cancel.cancel();
            if let Some(a) = &e.abort {
                a.abort();
            }
            e.state = TaskState::Cancelled;
            e.finished_at = Some(Instant::now());
        }
        Ok(e.state.clone())
    }
}
