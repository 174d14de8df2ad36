//! Endpoint URLs: `tcp://host:port`, `tcps://host:port`, `unix:///path`, `quic://host:port`,
//! `grpc://host:port`, `grpcs://host:port`, `grpc+unix:///path`, `shm://name`,
//! `ucx://host:port`, `http://host:port`.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// The transport a URL selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scheme {
    /// `tcp://host:port`
    Tcp,
    /// `tcps://host:port`: the same protocol over TLS
    Tcps,
    /// `unix:///path` (or `unix://@name` for a Linux abstract socket)
    Unix,
    /// `quic://host:port`
    Quic,
    /// `grpc://host:port` (plaintext HTTP/2)
    Grpc,
    /// `grpcs://host:port` (HTTP/2 over TLS)
    Grpcs,
    /// `grpc+unix:///path`
    GrpcUnix,
    /// `shm://name`: shared-memory payloads, control over a Unix socket
    Shm,
    /// `ucx://host:port`: control over TCP, large payloads through UCX
    Ucx,
    /// `http://host:port`: JSON-RPC 2.0 over HTTP/1.1 for clients in any
    /// language (served by the `tensorwire` server, not a transport here)
    Http,
}

impl Scheme {
    /// Every scheme.
    pub const ALL: [Scheme; 10] = [
        Scheme::Tcp,
        Scheme::Tcps,
        Scheme::Unix,
        Scheme::Quic,
        Scheme::Grpc,
        Scheme::Grpcs,
        Scheme::GrpcUnix,
        Scheme::Shm,
        Scheme::Ucx,
        Scheme::Http,
    ];

    /// The URL prefix without `://`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Scheme::Tcp => "tcp",
            Scheme::Tcps => "tcps",
            Scheme::Unix => "unix",
            Scheme::Quic => "quic",
            Scheme::Grpc => "grpc",
            Scheme::Grpcs => "grpcs",
            Scheme::GrpcUnix => "grpc+unix",
            Scheme::Shm => "shm",
            Scheme::Ucx => "ucx",
            Scheme::Http => "http",
        }
    }

    /// The cargo feature that enables the scheme.
    pub const fn feature(self) -> &'static str {
        match self {
            Scheme::Tcp => "tcp",
            Scheme::Tcps => "tcps",
            Scheme::Unix => "unix",
            Scheme::Quic => "quic",
            Scheme::Grpc | Scheme::Grpcs | Scheme::GrpcUnix => "grpc",
            Scheme::Shm => "shm",
            Scheme::Ucx => "ucx",
            Scheme::Http => "http",
        }
    }

    /// True when this build includes the scheme.
    pub const fn is_enabled(self) -> bool {
        match self {
            Scheme::Tcp => cfg!(feature = "tcp"),
            Scheme::Tcps => cfg!(feature = "tcps"),
            Scheme::Unix => cfg!(feature = "unix"),
            Scheme::Quic => cfg!(feature = "quic"),
            Scheme::Grpc | Scheme::Grpcs | Scheme::GrpcUnix => cfg!(feature = "grpc"),
            Scheme::Shm => cfg!(feature = "shm"),
            Scheme::Ucx => cfg!(feature = "ucx"),
            Scheme::Http => cfg!(feature = "http"),
        }
    }

    /// True for schemes addressed by a filesystem path.
    pub const fn has_path(self) -> bool {
        matches!(self, Scheme::Unix | Scheme::GrpcUnix)
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A URL that names no usable endpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid endpoint {url:?}: {reason}")]
pub struct EndpointError {
    /// The URL as given.
    pub url: String,
    /// What is wrong with it.
    pub reason: String,
}

/// Where to connect or listen, parsed from a URL.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    scheme: Scheme,
    host: String,
    port: u16,
    path: PathBuf,
    name: String,
    query: Vec<(String, String)>,
}

impl Endpoint {
    /// Parses a URL (see the [module docs](self)).
    pub fn parse(url: &str) -> Result<Self, EndpointError> {
        let err = |reason: &str| EndpointError { url: url.to_string(), reason: reason.to_string() };
        let (scheme_str, rest) = url.split_once("://").ok_or_else(|| {
            err("expected SCHEME://..., e.g. tcp://127.0.0.1:7070, unix:///tmp/tw.sock, quic://host:7071, grpc://host:50051, shm://name, http://host:8080")
        })?;
        let scheme =
            Scheme::ALL.into_iter().find(|s| s.as_str() == scheme_str.to_ascii_lowercase()).ok_or_else(|| {
                err(&format!(
                    "unknown scheme {scheme_str:?}; known: tcp, unix, quic, grpc, grpcs, grpc+unix, shm, ucx, http"
                ))
            })?;
        let (body, query_str) = rest.split_once('?').unwrap_or((rest, ""));
        // http://host:port/ and http://host:port/rpc name the same server.
        let body = if scheme == Scheme::Http { body.split_once('/').map_or(body, |(b, _)| b) } else { body };
        let mut query = Vec::new();
        for pair in query_str.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            query.push((k.to_string(), v.to_string()));
        }
        let mut ep =
            Endpoint { scheme, host: String::new(), port: 0, path: PathBuf::new(), name: String::new(), query };
        match scheme {
            Scheme::Unix | Scheme::GrpcUnix => {
                if body.is_empty() {
                    return Err(err("missing socket path, e.g. unix:///run/tensorwire.sock"));
                }
                ep.path = PathBuf::from(body);
            }
            Scheme::Shm => {
                if body.is_empty()
                    || body.len() > 200
                    || !body.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                {
                    return Err(err("shm names are 1-200 characters of letters, digits, '-', '_' and '.'"));
                }
                ep.name = body.to_string();
            }
            _ => {
                let (host, port) = split_host_port(body).ok_or_else(|| err("expected HOST:PORT"))?;
                if host.is_empty() {
                    return Err(err("missing host"));
                }
                ep.port = port.parse().map_err(|_| err(&format!("port {port:?} is not a number from 0 to 65535")))?;
                ep.host = host.to_string();
            }
        }
        Ok(ep)
    }

    /// The scheme.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// Host name or address (network schemes), without IPv6 brackets.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// Port (network schemes).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `host:port` as a socket address string (IPv6 bracketed).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// Socket path (Unix schemes). A leading `@` names a Linux abstract socket.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Segment name (`shm`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A query parameter (`?key=value`).
    pub fn query(&self, key: &str) -> Option<&str> {
        self.query.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// All query parameters in order.
    pub fn query_pairs(&self) -> &[(String, String)] {
        &self.query
    }

    /// The same endpoint with another port (used once a listener on port 0
    /// knows its real port).
    pub fn with_port(&self, port: u16) -> Self {
        Self { port, ..self.clone() }
    }
}

fn split_host_port(s: &str) -> Option<(&str, &str)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        let port = after.strip_prefix(':')?;
        return Some((host, port));
    }
    let (host, port) = s.rsplit_once(':')?;
    if host.contains(':') {
        return None; // IPv6 without brackets
    }
    Some((host, port))
}

impl FromStr for Endpoint {
    type Err = EndpointError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Endpoint::parse(s)
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://", self.scheme)?;
        match self.scheme {
            Scheme::Unix | Scheme::GrpcUnix => write!(f, "{}", self.path.display())?,
            Scheme::Shm => f.write_str(&self.name)?,
            _ => f.write_str(&self.authority())?,
        }
        for (i, (k, v)) in self.query.iter().enumerate() {
            write!(f, "{}{k}={v}", if i == 0 { '?' } else { '&' })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_scheme() {
        let e = Endpoint::parse("tcp://127.0.0.1:7070").unwrap();
        assert_eq!((e.scheme(), e.host(), e.port()), (Scheme::Tcp, "127.0.0.1", 7070));
        let e = Endpoint::parse("quic://[::1]:0").unwrap();
        assert_eq!((e.host(), e.port(), e.authority().as_str()), ("::1", 0, "[::1]:0"));
        let e = Endpoint::parse("unix:///tmp/a.sock?shm=1").unwrap();
        assert_eq!(e.path(), std::path::Path::new("/tmp/a.sock"));
        assert_eq!(e.query("shm"), Some("1"));
        assert_eq!(e.to_string(), "unix:///tmp/a.sock?shm=1");
        assert_eq!(Endpoint::parse("grpc+unix:///x").unwrap().scheme(), Scheme::GrpcUnix);
        let u = Endpoint::parse("ucx://10.0.0.2:7070").unwrap();
        assert_eq!((u.scheme(), u.host(), u.port()), (Scheme::Ucx, "10.0.0.2", 7070));
        assert_eq!(Endpoint::parse("shm://train-0").unwrap().name(), "train-0");
        assert_eq!(Endpoint::parse("grpcs://example.com:443").unwrap().to_string(), "grpcs://example.com:443");
        let e = Endpoint::parse("http://127.0.0.1:8080/rpc").unwrap();
        assert_eq!((e.scheme(), e.port(), e.to_string().as_str()), (Scheme::Http, 8080, "http://127.0.0.1:8080"));
    }

    #[test]
    fn clear_errors() {
        for (url, needle) in [
            ("127.0.0.1:80", "SCHEME://"),
            ("ftp://x:1", "unknown scheme"),
            ("tcp://x", "HOST:PORT"),
            ("tcp://x:99999", "port"),
            ("tcp://:80", "missing host"),
            ("unix://", "socket path"),
            ("shm://a/b", "shm names"),
            ("tcp://::1:80", "HOST:PORT"),
        ] {
            let e = Endpoint::parse(url).unwrap_err();
            assert!(e.to_string().contains(needle), "{url}: {e}");
        }
    }
}
