//! Certificates on every TLS transport (`quic://`, `tcps://`, `grpcs://`)
//! over real loopback sockets: self-signed and pinned, CA-signed, wrong
//! name, wrong CA, mutual TLS. The transport-independent suite runs over
//! each of them in `pipeline.rs`.

mod common;

use common::pki::pki;
use common::*;
use tensorwire::builtins::random_tensor;
use tensorwire::{Client, ClientConfig, DType, ServerConfig, TransportConfig};
use tensorwire_transports::Endpoint;
use tensorwire_transports::config::TlsConfig;

fn server_config(tls: TlsConfig) -> ServerConfig {
    ServerConfig { transport: TransportConfig { tls, ..TransportConfig::default() }, ..ServerConfig::default() }
}

fn client_config(tls: TlsConfig) -> ClientConfig {
    ClientConfig { transport: TransportConfig { tls, ..TransportConfig::default() }, ..ClientConfig::default() }
}

fn port_of(url: &str) -> u16 {
    Endpoint::parse(url).unwrap().port()
}

async fn works(url: &str, cfg: ClientConfig) {
    let c = Client::connect_with(url, cfg).await.unwrap_or_else(|e| panic!("{url}: {e}"));
    let x = random_tensor(DType::Float32, &[257], 1).unwrap();
    assert_same(&x, &c.compute("identity", vec![x.clone()]).await.unwrap()[0]);
}

async fn refused(url: &str, cfg: ClientConfig) -> String {
    match Client::connect_with(url, cfg).await {
        Ok(c) => match c.health().await {
            Ok(h) => panic!("{url}: expected a TLS failure, the server answered health={h}"),
            Err(e) => e.to_string(),
        },
        Err(e) => e.to_string(),
    }
}

async fn self_signed_server_is_trusted_by_its_pin_only(scheme: &str) {
    let (server, _d) = start(store_server(ServerConfig::default()), scheme).await;
    let url = server.url();
    let pin = Endpoint::parse(&url).unwrap().query("pin-sha256").expect("the URL carries the pin").to_string();
    assert_eq!(pin.len(), 64);
    // The URL printed by the server is enough.
    works(&url, ClientConfig::default()).await;
    // Without the pin, the self-signed certificate is not trusted, and the
    // error says why and what to do.
    let bare = format!("{scheme}://127.0.0.1:{}", port_of(&url));
    let e = refused(&bare, client_config(TlsConfig { ca_path: Some(_d_ca_absent()), ..Default::default() })).await;
    assert!(e.contains("cannot read certificates"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let other = pki(dir.path(), "other");
    let e = refused(&bare, client_config(TlsConfig { ca_path: Some(other.ca), ..Default::default() })).await;
    assert!(e.contains("UnknownIssuer") && e.contains("--pin-sha256"), "{e}");
    // The pin as a setting, in upper case with colons, works too.
    let colons = pin.as_bytes().chunks(2).map(|c| std::str::from_utf8(c).unwrap().to_uppercase()).collect::<Vec<_>>();
    works(&bare, client_config(TlsConfig { pin_sha256: Some(colons.join(":")), ..Default::default() })).await;
    // A wrong pin is refused, naming both fingerprints.
    let wrong = "ab".repeat(32);
    let e = refused(&bare, client_config(TlsConfig { pin_sha256: Some(wrong.clone()), ..Default::default() })).await;
    assert!(e.contains("does not match the pinned") && e.contains(&wrong) && e.contains(&pin), "{e}");
    // The explicit opt-out connects to anyone.
    works(&bare, client_config(TlsConfig { insecure_skip_verify_dangerous: true, ..Default::default() })).await;
}

fn _d_ca_absent() -> std::path::PathBuf {
    std::path::PathBuf::from("/nonexistent/tensorwire-ca.pem")
}

async fn ca_signed_certificate_is_checked_for_issuer_and_name(scheme: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (pki(dir.path(), "a"), pki(dir.path(), "b"));
    let tls = TlsConfig {
        cert_path: Some(a.server_cert.clone()),
        key_path: Some(a.server_key.clone()),
        ..Default::default()
    };
    let (server, _d) = start(store_server(server_config(tls)), scheme).await;
    let url = server.url();
    assert!(!url.contains("pin-sha256"), "a server with its own certificate adds no pin: {url}");
    let port = port_of(&url);
    let trust =
        |ca: &std::path::Path| client_config(TlsConfig { ca_path: Some(ca.to_path_buf()), ..Default::default() });
    // Right CA, right name (given in the URL, as the host is an address).
    works(&format!("{scheme}://127.0.0.1:{port}?server-name=localhost"), trust(&a.ca)).await;
    // The CA in the URL instead of the config.
    works(&format!("{scheme}://127.0.0.1:{port}?server-name=localhost&ca={}", a.ca.display()), ClientConfig::default())
        .await;
    // Another CA: refused as an unknown issuer.
    let e = refused(&format!("{scheme}://127.0.0.1:{port}?server-name=localhost"), trust(&b.ca)).await;
    assert!(e.contains("UnknownIssuer") && e.contains("TLS"), "{e}");
    // Right CA, but the certificate does not name 127.0.0.1.
    let e = refused(&format!("{scheme}://127.0.0.1:{port}"), trust(&a.ca)).await;
    assert!(e.contains("not valid for name") && e.contains("server-name"), "{e}");
}

async fn mutual_tls_refuses_clients_without_a_certificate_from_the_ca(scheme: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (pki(dir.path(), "a"), pki(dir.path(), "b"));
    let tls = TlsConfig {
        cert_path: Some(a.server_cert.clone()),
        key_path: Some(a.server_key.clone()),
        ca_path: Some(a.ca.clone()),
        require_client_cert: true,
        ..Default::default()
    };
    let (server, _d) = start(store_server(server_config(tls)), scheme).await;
    let url = format!("{scheme}://127.0.0.1:{}?server-name=localhost", port_of(&server.url()));
    let client = |cert: Option<(&std::path::Path, &std::path::Path)>| {
        client_config(TlsConfig {
            ca_path: Some(a.ca.clone()),
            client_cert_path: cert.map(|c| c.0.to_path_buf()),
            client_key_path: cert.map(|c| c.1.to_path_buf()),
            ..Default::default()
        })
    };
    // With TLS 1.3 the client finishes its side of the handshake before the
    // server checks its certificate, so the refusal arrives as an alert —
    // or, when the client's next write meets the closed socket first, as a
    // broken connection; and over gRPC, when the server's hang-up reaches
    // hyper as a plain end of stream, as a closed connection with no cause
    // (seen about once in a hundred runs under load). Either way the call
    // fails, and fails at once.
    let refusal = |e: &str, alert: &str| {
        let l = e.to_lowercase().replace('_', "");
        l.contains(alert)
            || l.contains("broken pipe")
            || l.contains("reset by peer")
            || (scheme == "grpcs" && (l.contains("connection is closed") || l.contains("channel closed")))
    };
    let e = refused(&url, client(None)).await;
    assert!(refusal(&e, "certificaterequired"), "{e}");
    let e = refused(&url, client(Some((&b.client_cert, &b.client_key)))).await;
    assert!(refusal(&e, "alert"), "{e}");
    works(&url, client(Some((&a.client_cert, &a.client_key)))).await;
    // A server certificate cannot stand in for a client one.
    let e = refused(&url, client(Some((&a.server_cert, &a.server_key)))).await;
    assert!(refusal(&e, "alert"), "{e}");
    // Refusals cost the server nothing: it still serves.
    works(&url, client(Some((&a.client_cert, &a.client_key)))).await;
}

/// One `#[tokio::test]` per certificate scenario, on each TLS transport.
macro_rules! tls_suite {
    ($($name:ident => $scheme:literal),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn self_signed_server_is_trusted_by_its_pin_only() {
                super::self_signed_server_is_trusted_by_its_pin_only($scheme).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ca_signed_certificate_is_checked_for_issuer_and_name() {
                super::ca_signed_certificate_is_checked_for_issuer_and_name($scheme).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mutual_tls_refuses_clients_without_a_certificate_from_the_ca() {
                super::mutual_tls_refuses_clients_without_a_certificate_from_the_ca($scheme).await
            }
        }
    )*};
}

tls_suite!(quic => "quic", tcps => "tcps", grpcs => "grpcs");
