//! A Prometheus text endpoint (`GET /metrics`) for a running server, built
//! on `prometheus-client`. The figures are read from the server's own
//! counters at scrape time, so serving metrics costs nothing between scrapes.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `tensorwire_calls` | counter | |
//! | `tensorwire_call_failures` | counter | |
//! | `tensorwire_active_calls` | gauge | |
//! | `tensorwire_received_bytes` / `tensorwire_sent_bytes` | counter | |
//! | `tensorwire_uptime_seconds` | gauge | |
//! | `tensorwire_serving` | gauge (1 serving, 0 shutting down) | |
//! | `tensorwire_store_bytes` / `_tensors` / `_max_bytes` | gauge (store services only) | |
//! | `tensorwire_function_calls` / `_failures` / `_batches` | counter | `function` |
//! | `tensorwire_function_seconds` | counter | `function` |

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::server::running::RunningServer;
use crate::server::state::ServerInner;

#[derive(Debug)]
struct ServerCollector(std::sync::Weak<ServerInner>);

impl std::fmt::Debug for ServerInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerInner").field("service_name", &self.config.service_name).finish_non_exhaustive()
    }
}

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(name, help, None, c.metric_type())?)
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: f64) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for ServerCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(s) = self.0.upgrade() else { return Ok(()) };
        let st = &s.stats;
        counter(&mut e, "tensorwire_calls", "Calls served", st.calls.load(Ordering::Relaxed))?;
        counter(
            &mut e,
            "tensorwire_call_failures",
            "Calls that ended in an error",
            st.failures.load(Ordering::Relaxed),
        )?;
        gauge(&mut e, "tensorwire_active_calls", "Calls in progress", st.active.load(Ordering::Relaxed) as f64)?;
        counter(
            &mut e,
            "tensorwire_received_bytes",
            "Tensor payload bytes received",
            st.bytes_received.load(Ordering::Relaxed),
        )?;
        counter(&mut e, "tensorwire_sent_bytes", "Tensor payload bytes sent", st.bytes_sent.load(Ordering::Relaxed))?;
        gauge(
            &mut e,
            "tensorwire_uptime_seconds",
            "Seconds since the server started",
            s.started.elapsed().as_secs_f64(),
        )?;
        gauge(
            &mut e,
            "tensorwire_serving",
            "1 while serving, 0 during shutdown",
            f64::from(u8::from(s.serving.load(Ordering::Relaxed))),
        )?;
        gauge(&mut e, "tensorwire_memory_used_bytes", "Bytes reserved from the memory budget", s.budget.used() as f64)?;
        gauge(
            &mut e,
            "tensorwire_memory_limit_bytes",
            "The memory budget (max_memory_bytes)",
            s.budget.limit() as f64,
        )?;
        let pool = s.pool.stats();
        counter(
            &mut e,
            "tensorwire_recv_pool_hits",
            "Receives served by a recycled buffer of the receive pool",
            pool.hits,
        )?;
        counter(
            &mut e,
            "tensorwire_recv_pool_misses",
            "Pooled-size receives that allocated a new buffer",
            pool.misses,
        )?;
        gauge(
            &mut e,
            "tensorwire_recv_pool_hit_ratio",
            "Receive pool hits over all pooled-size receives",
            pool.hit_rate(),
        )?;
        gauge(
            &mut e,
            "tensorwire_recv_pool_idle_bytes",
            "Bytes of receive buffers idle in the pool",
            pool.idle_bytes as f64,
        )?;
        if let Some(u) = s.service.usage() {
            gauge(&mut e, "tensorwire_store_bytes", "Bytes of the tensors the store holds", u.bytes as f64)?;
            gauge(&mut e, "tensorwire_store_tensors", "Tensors the store holds", u.tensors as f64)?;
            gauge(&mut e, "tensorwire_store_max_bytes", "The store's budget in bytes", u.max_bytes as f64)?;
        }
        let funcs: Vec<_> = s.functions.iter().collect();
        let families: [(&str, &str, MetricType); 4] = [
            (
                "tensorwire_function_calls",
                "Calls of a named function (examples, for batched ones)",
                MetricType::Counter,
            ),
            ("tensorwire_function_failures", "Failed calls of a named function", MetricType::Counter),
            (
                "tensorwire_function_batches",
                "Runs of a named function (batches, for batched ones)",
                MetricType::Counter,
            ),
            ("tensorwire_function_seconds", "Seconds spent in a named function", MetricType::Counter),
        ];
        for (i, (name, help, ty)) in families.into_iter().enumerate() {
            let mut m = e.encode_descriptor(name, help, None, ty)?;
            for f in &funcs {
                let c = f.stats.counters();
                let labels = [("function", f.name.as_str())];
                let mut fam = m.encode_family(&labels)?;
                match i {
                    0 => fam.encode_counter::<NoLabelSet, _, u64>(&c.calls.load(Ordering::Relaxed), None)?,
                    1 => fam.encode_counter::<NoLabelSet, _, u64>(&c.failures.load(Ordering::Relaxed), None)?,
                    2 => fam.encode_counter::<NoLabelSet, _, u64>(&c.batches.load(Ordering::Relaxed), None)?,
                    _ => {
                        let secs = c.total_us.load(Ordering::Relaxed) as f64 / 1e6;
                        fam.encode_counter::<NoLabelSet, _, f64>(&secs, None)?
                    }
                }
            }
        }
        Ok(())
    }
}

/// The metrics endpoint; stops when dropped.
#[derive(Debug)]
pub struct MetricsEndpoint {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl MetricsEndpoint {
    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RunningServer {
    /// Serves Prometheus text metrics at `http://ADDR/metrics` (e.g.
    /// `127.0.0.1:9100`; port 0 picks one) until the returned handle drops.
    pub async fn serve_metrics(&self, addr: &str) -> std::io::Result<MetricsEndpoint> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let mut registry = Registry::default();
        registry.register_collector(Box::new(ServerCollector(Arc::downgrade(self.inner()))));
        let registry = Arc::new(registry);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let registry = registry.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let registry = registry.clone();
                        async move { Ok::<_, std::convert::Infallible>(respond(&req, &registry)) }
                    });
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await;
                });
            }
        });
        tracing::info!(%local, "metrics at /metrics");
        Ok(MetricsEndpoint { addr: local, task })
    }
}

fn respond(req: &Request<hyper::body::Incoming>, registry: &Registry) -> Response<Full<Bytes>> {
    let plain = |status: StatusCode, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r
    };
    if req.method() != hyper::Method::GET || req.uri().path() != "/metrics" {
        return plain(StatusCode::NOT_FOUND, "try GET /metrics\n".into());
    }
    let mut body = String::new();
    if prometheus_client::encoding::text::encode(&mut body, registry).is_err() {
        return plain(StatusCode::INTERNAL_SERVER_ERROR, "encoding failed\n".into());
    }
    let mut r = plain(StatusCode::OK, body);
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    r
}
