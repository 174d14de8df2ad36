//! Transport settings: plain structs with documented units and defaults.

use std::path::PathBuf;
use std::time::Duration;

/// Settings shared by all transports. Sizes in bytes.
#[derive(Clone, Debug)]
pub struct TransportConfig {
    /// Bytes one stream may have in flight unread by the receiver: the
    /// sender waits for credit beyond it, and a peer that sends more is cut
    /// off (default 8 MiB). Must exceed the largest frame.
    pub stream_window: u32,
    /// Bytes received on one connection and not yet consumed, across all
    /// streams, after which the reader stops reading the socket until
    /// consumers catch up (default 256 MiB). Bounds memory per connection.
    /// A gRPC server connection's calls hold at most this much in
    /// unfinished messages (at least one whole message) before a call
    /// waits for room ([`GrpcConfig::room_wait`]), and at most twice it.
    pub connection_window: u64,
    /// Largest payload of one frame this side accepts (default 64 MiB).
    pub max_frame_payload: u32,
    /// Largest frame header this side accepts (default 1 MiB).
    pub max_header_bytes: u32,
    /// Most streams the peer may have open at once (default 1024).
    pub max_concurrent_streams: u32,
    /// Most connections a gRPC listener keeps open at once; a new one past
    /// it is sent an HTTP/2 GOAWAY saying why and closed (default None: no
    /// cap of its own; a tensorwire server sets its
    /// `ServerConfig::max_connections` here). Other listeners leave
    /// admission to the server.
    pub max_connections: Option<usize>,
    /// Most of those from one IP address (Unix sockets: one peer; default
    /// None: no cap of its own; a tensorwire server sets its
    /// `ServerConfig::max_connections_per_peer` here).
    pub max_connections_per_peer: Option<usize>,
    /// Give up connecting after this long (default 10 s). Servers give an
    /// accepted socket as long for its handshake (the mux preface, gRPC's
    /// TLS handshake).
    pub connect_timeout: Duration,
    /// Send keep-alive probes (mux PINGs, TCP keep-alive) this often on a
    /// quiet connection; a mux peer that answers nothing for three intervals
    /// is closed (default 15 s; None: off).
    pub keepalive_interval: Option<Duration>,
    /// Close a mux connection (tcp, unix, shm) that has had no open stream
    /// for this long (default 5 minutes; checked every keep-alive interval;
    /// a client reconnects on its next call). QUIC uses
    /// [`QuicConfig::idle_timeout`].
    pub idle_timeout: Option<Duration>,
    /// How long a connection's reader keeps polling for bytes after it last
    /// read some, before it sleeps until the runtime or the peer wakes it
    /// (default 50 µs). Applies to the mux over sockets (tcp, tcps, unix),
    /// the shared-memory rings (whose writer also polls this long for room)
    /// and UCX's progress thread; not to gRPC or QUIC. A reply within it
    /// costs no thread wake-up — tens of microseconds each way on a VM — so
    /// a small call over loopback takes a fraction of a sleeping ping-pong.
    /// The first write after a quiet spell starts one more spin (a request
    /// is followed by a spin for its reply, waking the reader if it slept);
    /// further writes alone do not, so a long one-way send does not keep its
    /// reader busy. It costs CPU only right after traffic, and an idle
    /// connection nothing. Zero: sleep at once (UCX's progress thread still
    /// polls a few dozen times first).
    pub spin: Duration,
    /// Kernel socket buffer sizes (SO_SNDBUF/SO_RCVBUF); None keeps the
    /// OS default (default 4 MiB each for TCP, raised where allowed).
    pub socket_buffer: Option<usize>,
    /// TLS settings (QUIC, gRPC over TLS).
    pub tls: TlsConfig,
    /// QUIC settings.
    pub quic: QuicConfig,
    /// gRPC settings.
    pub grpc: GrpcConfig,
    /// Shared-memory settings (`shm://`, and `unix://` upgraded to it).
    pub shm: ShmConfig,
    /// UCX settings (`ucx://`).
    pub ucx: UcxConfig,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            stream_window: 8 << 20,
            connection_window: 256 << 20,
            max_frame_payload: 64 << 20,
            max_header_bytes: 1 << 20,
            max_concurrent_streams: 1024,
            max_connections: None,
            max_connections_per_peer: None,
            connect_timeout: Duration::from_secs(10),
            keepalive_interval: Some(Duration::from_secs(15)),
            idle_timeout: Some(Duration::from_secs(300)),
            spin: Duration::from_micros(50),
            socket_buffer: Some(4 << 20),
            tls: TlsConfig::default(),
            quic: QuicConfig::default(),
            grpc: GrpcConfig::default(),
            shm: ShmConfig::default(),
            ucx: UcxConfig::default(),
        }
    }
}

/// Shared-memory payloads between processes on one host. Tensors at least
/// `min_tensor_bytes` large travel in a sealed memfd segment: the sender
/// copies the tensor in once, the receiver maps it and uses it in place.
#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// `unix://` clients offer shared memory to the server, which accepts
    /// when it has it enabled too (default true; URL `?shm=0` turns it off
    /// for one endpoint). `shm://` always uses it.
    pub unix_upgrade: bool,
    /// Smallest tensor payload sent through shared memory (default 256 KiB);
    /// smaller ones go through the socket, where a copy costs less than a
    /// segment.
    pub min_tensor_bytes: u64,
    /// Largest tensor payload mapped from one segment a peer passes
    /// (default 16 GiB): a peer's larger segment is refused. (A sender puts
    /// at most `max_in_flight` bytes in one segment; larger tensors go
    /// through the rings or the socket.)
    pub max_segment_bytes: u64,
    /// Bytes of segments one connection may have passed to the peer and not
    /// yet seen taken (default 1 GiB): the sender waits beyond it, so a slow
    /// receiver bounds the sender's shared memory. It is also the most the
    /// sender's segment pool keeps; a larger tensor goes through the rings
    /// (or the socket), never in a segment of its own. Segments are whole
    /// MiB, so below 1 MiB no tensor uses one.
    pub max_in_flight: u64,
    /// A segment whose frame failed to leave (its stream was reset or
    /// stopped) and that the peer has not taken after this long is dropped
    /// (default 30 s); a frame that left is never dropped (a slow receiver
    /// reads it late; one dropped unread is reported back at once). A frame
    /// naming a segment that has not arrived within it fails.
    pub segment_timeout: Duration,
    /// Bytes of each direction's shared-memory ring (default 256 KiB,
    /// rounded up to a power of two between 4 KiB and 16 MiB; 0: none):
    /// with rings, a client that offers shared memory moves the whole mux
    /// byte stream (headers, small tensors, chunks no segment carries)
    /// through memory the two processes share instead of the Unix socket,
    /// which then only tells each side when the other is gone. The client
    /// decides; a server accepts the rings a client offers. URL `?ring=0`
    /// turns them off for one endpoint.
    pub ring_bytes: usize,
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self {
            unix_upgrade: true,
            min_tensor_bytes: 256 << 10,
            max_segment_bytes: 16 << 30,
            max_in_flight: 1 << 30,
            segment_timeout: Duration::from_secs(30),
            ring_bytes: 256 << 10,
        }
    }
}

/// `ucx://`: frames (headers, small payloads) travel as a UCP stream; chunk
/// payloads at least `min_chunk_bytes` large as UCX tagged messages
/// (rendezvous: the receiver pulls them into its buffer, zero-copy on RDMA
/// NICs).
#[derive(Clone, Debug)]
pub struct UcxConfig {
    /// Smallest uncompressed chunk payload sent through UCX (default 64 KiB).
    pub min_chunk_bytes: usize,
    /// Payload bytes one stream may have handed to UCX and not yet seen
    /// delivered; the sender waits beyond it (default 256 MiB). Also the
    /// most scratch memory a connection receives the payloads of frames
    /// nobody reads into (a dropped receiver's), at a time.
    pub max_in_flight: usize,
    /// A payload not delivered (sender) or not arrived (receiver) within
    /// this long fails its stream: the peer stopped reading or lied about a
    /// payload (default 60 s); a receive that times out is cancelled, its
    /// buffer freed (as is a scratch receive of a payload nobody reads): a
    /// payload the peer sends after that is never received, and the peer's
    /// send of it stays pending until the connection closes.
    pub rendezvous_timeout: Duration,
    /// Tensors of at least this many payload bytes ask the receiver for
    /// memory to put their chunks into, where the connection's UCX context
    /// has only shared-memory transports (one copy instead of the tagged
    /// rendezvous's two; default 8 MiB).
    pub min_put_bytes: u64,
}

impl Default for UcxConfig {
    fn default() -> Self {
        Self {
            min_put_bytes: 8 << 20,
            min_chunk_bytes: 64 << 10,
            max_in_flight: 256 << 20,
            rendezvous_timeout: Duration::from_secs(60),
        }
    }
}

/// TLS for QUIC, `tcps://` and `grpcs://`. Safe by default: a client verifies the
/// server against the system roots, a CA file, or a pinned certificate
/// fingerprint; skipping verification is a loudly named opt-in.
#[derive(Clone, Debug, Default)]
pub struct TlsConfig {
    /// Server: certificate chain (PEM). None: a self-signed certificate is
    /// generated at start and its SHA-256 fingerprint logged.
    pub cert_path: Option<PathBuf>,
    /// Server: private key (PEM).
    pub key_path: Option<PathBuf>,
    /// Client: trust this CA (PEM) for the server; server: require client
    /// certificates signed by it (mutual TLS) when `require_client_cert`.
    pub ca_path: Option<PathBuf>,
    /// Client: accept a server whose certificate has this SHA-256
    /// fingerprint (hex, colons allowed), whatever its issuer.
    pub pin_sha256: Option<String>,
    /// Client: the name to verify in the server certificate (default: the URL host).
    pub server_name: Option<String>,
    /// Client: certificate (PEM) presented for mutual TLS.
    pub client_cert_path: Option<PathBuf>,
    /// Client: key (PEM) for `client_cert_path`.
    pub client_key_path: Option<PathBuf>,
    /// Server: refuse clients without a certificate signed by `ca_path`.
    pub require_client_cert: bool,
    /// Client: accept any server certificate. For development only: it
    /// gives up all protection against impersonation.
    pub insecure_skip_verify_dangerous: bool,
}

/// Congestion controller for QUIC.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Congestion {
    /// CUBIC (default): robust on shared links.
    #[default]
    Cubic,
    /// BBR: higher throughput on long fat links with loss.
    Bbr,
    /// NewReno: conservative.
    NewReno,
}

impl std::str::FromStr for Congestion {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "cubic" => Ok(Congestion::Cubic),
            "bbr" => Ok(Congestion::Bbr),
            "newreno" | "reno" => Ok(Congestion::NewReno),
            _ => Err(format!("unknown congestion controller {s:?}: expected cubic, bbr or newreno")),
        }
    }
}

/// QUIC tuning. Defaults are sized for a high bandwidth-delay product:
/// quinn's own defaults cap one stream near 100 Mbit/s at 100 ms RTT.
#[derive(Clone, Debug)]
pub struct QuicConfig {
    /// Receive window of one stream (default 32 MiB).
    pub stream_receive_window: u64,
    /// Receive window of the connection (default 128 MiB).
    pub receive_window: u64,
    /// Send window (default 128 MiB).
    pub send_window: u64,
    /// Congestion controller (default CUBIC).
    pub congestion: Congestion,
    /// UDP socket buffer size to ask the OS for (default 8 MiB; the OS may cap it).
    pub udp_buffer: usize,
    /// Send a keep-alive packet after this long without traffic (default
    /// 5 s), so a live peer is never closed by the idle timeout; None: off.
    pub keep_alive: Option<Duration>,
    /// Close the connection after this long without any packet from the
    /// peer (default 30 s): a peer that died or vanished from the network is
    /// noticed within this time. The shorter of both sides' values applies.
    pub idle_timeout: Duration,
    /// Largest UDP payload in bytes (default 1472, an Ethernet MTU of 1500):
    /// path MTU discovery probes up to it and falls back where the path
    /// carries less; this side also announces it as the most it accepts
    /// (1200 to 65527). Raise it (e.g. 8952) on jumbo-frame LANs. Measured on
    /// loopback, larger datagrams did not help: a congestion loss of one big
    /// datagram made quinn's black-hole detector fall back to 1200 bytes, and
    /// forcing 8952 lost a third of the packets in the receive buffer.
    pub max_udp_payload: u16,
    /// Client: QUIC connections one logical connection is spread over
    /// (default 1: no striping; at most 16; URL: `?stripes=N`). Each
    /// connection has its own UDP socket and is driven by its own task, so
    /// more than one core encrypts and decrypts: payloads of 128 KiB and
    /// more go round-robin over them, in both directions, while every
    /// stream's frames stay in order. Pays off for large tensors on
    /// machines with cores to spare; small calls are unaffected.
    pub stripes: usize,
}

impl Default for QuicConfig {
    fn default() -> Self {
        Self {
            stream_receive_window: 32 << 20,
            receive_window: 128 << 20,
            send_window: 128 << 20,
            congestion: Congestion::Cubic,
            udp_buffer: 8 << 20,
            keep_alive: Some(Duration::from_secs(5)),
            idle_timeout: Duration::from_secs(30),
            max_udp_payload: 1472,
            stripes: 1,
        }
    }
}

/// gRPC (HTTP/2) tuning. hyper's defaults (1 MiB server windows, 16 KiB
/// frames) run at a fraction of TCP speed; these run near it.
#[derive(Clone, Debug)]
pub struct GrpcConfig {
    /// HTTP/2 stream window (default 16 MiB).
    pub stream_window: u32,
    /// HTTP/2 connection window (default 64 MiB).
    pub connection_window: u32,
    /// HTTP/2 max frame size (default 1 MiB; HTTP/2 allows up to 16 MiB - 1).
    pub max_frame_size: u32,
    /// Server: how long a call whose frame finds its connection's
    /// unfinished messages over
    /// [`TransportConfig::connection_window`] waits while no message on
    /// the connection completes, before it fails with `RESOURCE_EXHAUSTED`
    /// (default 2 s; see `grpc::unfinished_message_bytes`).
    pub room_wait: Duration,
}

impl Default for GrpcConfig {
    fn default() -> Self {
        Self {
            stream_window: 16 << 20,
            connection_window: 64 << 20,
            max_frame_size: 1 << 20,
            room_wait: Duration::from_secs(2),
        }
    }
}
