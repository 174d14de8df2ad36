//! Striping: one logical connection made of several QUIC connections.
//!
//! A QUIC connection is driven by one task, so encryption and packet
//! processing of all its streams share one core. With
//! [`QuicConfig::stripes`](crate::config::QuicConfig::stripes) = n > 1, the
//! client opens n - 1 more connections (each from its own UDP socket) and
//! joins them to the first, the *primary*:
//!
//! ```text
//!  primary (ALPN tensorwire/1)        uni stream: "TWG1" token(16) count(1)
//!  stripe i (ALPN tensorwire-stripe/1) uni stream: "TWJ1" token(16) index(1)
//! ```
//!
//! The token is 128 random bits: only the client that made the primary can
//! join stripes to it. Every logical stream still lives on the primary: all
//! frame headers travel there, in order. A large payload may instead travel
//! on stripe i, on a unidirectional stream that begins with the primary
//! stream's id (u64, little-endian) and then carries that logical stream's
//! striped payloads back to back; the header on the primary names the stripe
//! (see the `stream` module). The receiver therefore reads every payload in
//! order, while the stripes' connections receive, decrypt and buffer in
//! parallel on other cores, each within its own flow-control windows.
//! Either side stripes what it sends over the connections the client set up.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use quinn::VarInt;
use tokio::sync::Notify;

use crate::StreamError;
use crate::sync::lock;

/// ALPN of stripe connections: never handed to the application as connections.
pub const STRIPE_ALPN: &[u8] = b"tensorwire-stripe/1";

/// Most connections in one group (primary included).
pub const MAX_STRIPES: usize = 16;

/// Payloads at least this large are striped; smaller ones stay inline on the primary.
pub const STRIPE_MIN_PAYLOAD: usize = 128 << 10;

const GROUP_MAGIC: &[u8; 4] = b"TWG1";
const JOIN_MAGIC: &[u8; 4] = b"TWJ1";
/// How long a control message or a stripe stream may take to arrive.
pub(crate) const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a join waits for its group's announcement, which the client
/// sends first but which may arrive after the join (loss, reordering).
const JOIN_WAIT: Duration = Duration::from_secs(3);
/// Ids of finished streams remembered, so that stripe streams arriving after
/// their logical stream ended are refused rather than kept.
const CLOSED_MEMORY: usize = 4096;

pub(crate) type Token = [u8; 16];

/// A random group token.
pub(crate) fn new_token() -> Token {
    use ring::rand::SecureRandom;
    let mut t = [0u8; 16];
    // SystemRandom only fails when the OS has no randomness at all.
    ring::rand::SystemRandom::new().fill(&mut t).expect("the OS random source works");
    t
}

/// The control message a client sends on the primary (`count` = group size).
pub(crate) fn group_message(token: &Token, count: u8) -> Vec<u8> {
    [&GROUP_MAGIC[..], token, &[count]].concat()
}

/// The control message a client sends on stripe connection `index`.
pub(crate) fn join_message(token: &Token, index: u8) -> Vec<u8> {
    [&JOIN_MAGIC[..], token, &[index]].concat()
}

/// A parsed control message.
pub(crate) enum Control {
    Group { token: Token, count: u8 },
    Join { token: Token, index: u8 },
}

/// Reads one control message (21 bytes) from a fresh unidirectional stream.
pub(crate) async fn read_control(r: &mut quinn::RecvStream) -> Result<Control, String> {
    let mut m = [0u8; 21];
    match tokio::time::timeout(CONTROL_TIMEOUT, r.read_exact(&mut m)).await {
        Err(_) => return Err(format!("no control message within {CONTROL_TIMEOUT:?}")),
        Ok(Err(e)) => return Err(format!("truncated control message: {e}")),
        Ok(Ok(())) => {}
    }
    let token: Token = m[4..20].try_into().expect("16 bytes");
    match &m[..4] {
        x if x == GROUP_MAGIC => Ok(Control::Group { token, count: m[20] }),
        x if x == JOIN_MAGIC => Ok(Control::Join { token, index: m[20] }),
        other => Err(format!("unknown control message {other:02x?}")),
    }
}

/// Stripe streams that arrived, by (primary stream id, stripe index).
#[derive(Default)]
struct Registry {
    streams: HashMap<(u64, u8), quinn::RecvStream>,
    closed: HashSet<u64>,
    closed_order: VecDeque<u64>,
}

/// The connections of one logical connection and the stripe streams waiting
/// for their logical streams.
pub(crate) struct Group {
    /// Index 0 is the primary; None: a stripe not (or no longer) joined.
    conns: Mutex<Vec<Option<quinn::Connection>>>,
    registry: Mutex<Registry>,
    arrived: Notify,
    token: Mutex<Option<Token>>,
}

impl Group {
    pub(crate) fn new(primary: quinn::Connection) -> Arc<Self> {
        Arc::new(Self {
            conns: Mutex::new(vec![Some(primary)]),
            registry: Mutex::default(),
            arrived: Notify::new(),
            token: Mutex::new(None),
        })
    }

    fn conns(&self) -> std::sync::MutexGuard<'_, Vec<Option<quinn::Connection>>> {
        lock(&self.conns)
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        lock(&self.registry)
    }

    /// Whether the client announced a group (its stripes may join).
    pub(crate) fn announced(&self) -> bool {
        lock(&self.token).is_some()
    }

    /// Slots, joined or not (the group size the client announced).
    pub(crate) fn size(&self) -> usize {
        self.conns().len()
    }

    /// Indices of the live stripe connections (not the primary).
    pub(crate) fn live_stripes(&self, out: &mut Vec<u8>) {
        out.clear();
        for (i, c) in self.conns().iter().enumerate().skip(1) {
            if let Some(c) = c
                && c.close_reason().is_none()
            {
                out.push(i as u8);
            }
        }
    }

    /// The connection at `index`.
    pub(crate) fn conn(&self, index: u8) -> Option<quinn::Connection> {
        self.conns().get(usize::from(index)).cloned().flatten()
    }

    /// Announces the group size (primary side; once).
    pub(crate) fn expect(&self, token: Token, count: u8) -> Result<(), String> {
        let count = usize::from(count);
        if !(2..=MAX_STRIPES).contains(&count) {
            return Err(format!("a group of {count} connections (allowed: 2 to {MAX_STRIPES})"));
        }
        let mut t = lock(&self.token);
        if t.is_some() {
            return Err("a second group announcement".into());
        }
        *t = Some(token);
        self.conns().resize(count, None);
        drop(t);
        // Receivers may be waiting for this group's stripes (see `take`).
        self.arrived.notify_waiters();
        Ok(())
    }

    /// Joins a stripe connection at `index`.
    pub(crate) fn attach(&self, token: &Token, index: u8, conn: quinn::Connection) -> Result<(), String> {
        if lock(&self.token).as_ref() != Some(token) {
            return Err("wrong group token".into());
        }
        let mut conns = self.conns();
        match conns.get_mut(usize::from(index)) {
            Some(slot @ None) if index > 0 => {
                *slot = Some(conn);
                drop(conns);
                // Receivers may be waiting for this stripe to join.
                self.arrived.notify_waiters();
                Ok(())
            }
            Some(_) => Err(format!("stripe {index} joined twice")),
            None => Err(format!("stripe {index} of a group of {}", conns.len())),
        }
    }

    /// Closes every connection of the group.
    pub(crate) fn close(&self, reason: &str) {
        for c in self.conns().iter().flatten() {
            c.close(VarInt::from_u32(0), reason.as_bytes());
        }
    }

    /// Files a stripe stream that arrived on connection `index`.
    fn register(&self, id: u64, index: u8, mut stream: quinn::RecvStream) {
        let mut r = self.registry();
        if r.closed.contains(&id) {
            // Its logical stream is over: nobody will read this.
            let _ = stream.stop(VarInt::from_u32(0));
            return;
        }
        if let Some(mut old) = r.streams.insert((id, index), stream) {
            let _ = old.stop(VarInt::from_u32(0));
        }
        drop(r);
        self.arrived.notify_waiters();
    }

    /// The stripe stream `index` of the logical stream `id`, waiting for it
    /// to arrive (it is opened when its first payload is sent), and for the
    /// stripe to join if its join is still on its way.
    pub(crate) async fn take(&self, id: u64, index: u8, peer: &str) -> Result<quinn::RecvStream, StreamError> {
        let deadline = tokio::time::Instant::now() + CONTROL_TIMEOUT;
        loop {
            let notified = self.arrived.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if let Some(s) = self.registry().streams.remove(&(id, index)) {
                return Ok(s);
            }
            // None: the stripe has not joined yet (or the group is not yet
            // announced). Joins and the announcement travel on streams of
            // their own, so a header naming a stripe may come first: wait.
            let conn = self.conn(index);
            let closed = async {
                match &conn {
                    Some(c) => c.closed().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut notified => {}
                e = closed => return Err(super::errors::conn_error(peer, &e)),
                _ = tokio::time::sleep_until(deadline) => {
                    let what = if conn.is_some() { "the stream for stripe" } else { "the join of stripe" };
                    return Err(StreamError::Protocol {
                        peer: peer.to_string(),
                        reason: format!("{what} {index} did not arrive within {CONTROL_TIMEOUT:?}"),
                    });
                }
            }
        }
    }

    /// The logical stream `id` is over: drops its stripe streams, and any
    /// that arrive later.
    pub(crate) fn forget(&self, id: u64) {
        let mut r = self.registry();
        let size = self.conns.lock().map(|c| c.len()).unwrap_or(MAX_STRIPES);
        for i in 1..size {
            if let Some(mut s) = r.streams.remove(&(id, i as u8)) {
                let _ = s.stop(VarInt::from_u32(0));
            }
        }
        if r.closed.insert(id) {
            r.closed_order.push_back(id);
            if r.closed_order.len() > CLOSED_MEMORY
                && let Some(old) = r.closed_order.pop_front()
            {
                r.closed.remove(&old);
            }
        }
    }
}

/// Groups by token, for stripe connections to find their primary (server side).
#[derive(Default)]
pub(crate) struct GroupIndex {
    groups: Mutex<HashMap<Token, Weak<Group>>>,
    announced: Notify,
}

impl GroupIndex {
    fn insert(&self, token: Token, g: &Arc<Group>) {
        let mut m = lock(&self.groups);
        m.retain(|_, w| w.strong_count() > 0);
        m.insert(token, Arc::downgrade(g));
        drop(m);
        self.announced.notify_waiters();
    }

    /// The group announced with `token`, waiting a little for the
    /// announcement, which may arrive after the join.
    async fn find(&self, token: &Token) -> Option<Arc<Group>> {
        let deadline = tokio::time::Instant::now() + JOIN_WAIT;
        loop {
            let notified = self.announced.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if let Some(g) = lock(&self.groups).get(token).and_then(Weak::upgrade) {
                return Some(g);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }
}

/// Primary side of a server: reads the group announcement on the primary's
/// unidirectional streams (nothing else may come there).
pub(crate) async fn serve_primary_control(conn: quinn::Connection, group: Weak<Group>, index: Arc<GroupIndex>) {
    loop {
        let Ok(mut r) = conn.accept_uni().await else { return };
        let result = match read_control(&mut r).await {
            Ok(Control::Group { token, count }) => match group.upgrade() {
                Some(g) => g.expect(token, count).map(|()| index.insert(token, &g)),
                None => return,
            },
            Ok(Control::Join { .. }) => Err("a stripe join on a primary connection".into()),
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            tracing::info!(peer = %conn.remote_address(), error = %e, "closing QUIC connection: bad control stream");
            conn.close(VarInt::from_u32(1), format!("bad control stream: {e}").as_bytes());
            return;
        }
    }
}

/// Server side of a new stripe connection: reads its join message, attaches
/// it to its group, then serves its stripe streams.
pub(crate) async fn serve_stripe_join(conn: quinn::Connection, index: Arc<GroupIndex>) {
    let peer = conn.remote_address();
    let joined = async {
        let mut r = conn.accept_uni().await.map_err(|e| e.to_string())?;
        match read_control(&mut r).await? {
            Control::Join { token, index: i } => {
                let g = index.find(&token).await.ok_or("no group with this token")?;
                g.attach(&token, i, conn.clone())?;
                Ok::<_, String>((g, i))
            }
            Control::Group { .. } => Err("a group announcement on a stripe connection".into()),
        }
    };
    match tokio::time::timeout(CONTROL_TIMEOUT * 2, joined).await {
        Ok(Ok((g, i))) => {
            tracing::debug!(%peer, stripe = i, "stripe joined");
            let weak = Arc::downgrade(&g);
            drop(g);
            serve_stripe_streams(conn, weak, i).await;
        }
        Ok(Err(e)) => {
            tracing::info!(%peer, error = %e, "refused QUIC stripe connection");
            conn.close(VarInt::from_u32(1), format!("stripe refused: {e}").as_bytes());
        }
        Err(_) => conn.close(VarInt::from_u32(1), b"stripe join timed out"),
    }
}

/// Files every stripe stream arriving on stripe connection `index` with its
/// group; ends when the connection or the group goes.
pub(crate) async fn serve_stripe_streams(conn: quinn::Connection, group: Weak<Group>, index: u8) {
    loop {
        let Ok(mut r) = conn.accept_uni().await else { break };
        let mut id = [0u8; 8];
        match tokio::time::timeout(CONTROL_TIMEOUT, r.read_exact(&mut id)).await {
            Ok(Ok(())) => {}
            _ => {
                let _ = r.stop(VarInt::from_u32(1));
                continue;
            }
        }
        match group.upgrade() {
            Some(g) => g.register(u64::from_le_bytes(id), index, r),
            None => break,
        }
    }
    // The group is gone with its primary: so is this stripe.
    conn.close(VarInt::from_u32(0), b"group closed");
}
