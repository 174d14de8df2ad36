//! TLS for QUIC and gRPC over TLS: rustls with the ring provider only.
//!
//! Servers present a certificate from PEM files, or a self-signed one
//! generated at start whose SHA-256 fingerprint is logged and put in the
//! listener's URL (`?pin-sha256=...`), so `server.url()` is enough to connect.
//! Clients verify the server against, in order of preference: a pinned
//! fingerprint, a CA file, or the system's roots. Skipping verification is an
//! explicit, dangerous opt-in. Mutual TLS checks client certificates against
//! a CA.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::config::TlsConfig;
use crate::endpoint::Endpoint;

/// The one crypto provider used everywhere: ring.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Lowercase hex SHA-256 of a certificate (DER), as `--pin-sha256` takes it.
pub fn fingerprint(cert: &CertificateDer<'_>) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, cert.as_ref());
    d.as_ref().iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn normalize_pin(pin: &str) -> String {
    pin.chars().filter(|c| c.is_ascii_hexdigit()).collect::<String>().to_ascii_lowercase()
}

/// A server's certificate chain and key.
pub struct ServerIdentity {
    /// Leaf first.
    pub chain: Vec<CertificateDer<'static>>,
    /// The private key.
    pub key: PrivateKeyDer<'static>,
    /// SHA-256 of the leaf certificate.
    pub fingerprint: String,
    /// True when generated here (self-signed).
    pub generated: bool,
}

impl std::fmt::Debug for ServerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerIdentity")
            .field("fingerprint", &self.fingerprint)
            .field("generated", &self.generated)
            .finish()
    }
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read certificates from {}: {e}", path.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("bad PEM certificate in {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("no certificate found in {}", path.display()));
    }
    Ok(certs)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| format!("cannot read a private key from {}: {e}", path.display()))
}

fn load_roots(path: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(path)? {
        roots.add(c).map_err(|e| format!("unusable CA certificate in {}: {e}", path.display()))?;
    }
    Ok(roots)
}

/// The server's identity: from `cert_path`/`key_path`, or self-signed for
/// `localhost`, the loopback addresses and `hosts`.
pub fn server_identity(cfg: &TlsConfig, hosts: &[String]) -> Result<ServerIdentity, String> {
    match (&cfg.cert_path, &cfg.key_path) {
        (Some(c), Some(k)) => {
            let chain = load_certs(c)?;
            let key = load_key(k)?;
            let fingerprint = fingerprint(&chain[0]);
            Ok(ServerIdentity { chain, key, fingerprint, generated: false })
        }
        (Some(_), None) | (None, Some(_)) => {
            Err("give both a certificate and its key, or neither (for a self-signed one)".into())
        }
        (None, None) => {
            let mut names = vec!["localhost".to_string(), "127.0.0.1".to_string(), "::1".to_string()];
            for h in hosts {
                if !h.is_empty() && h != "0.0.0.0" && h != "::" && !names.contains(h) {
                    names.push(h.clone());
                }
            }
            let ck =
                rcgen::generate_simple_self_signed(names).map_err(|e| format!("cannot generate a certificate: {e}"))?;
            let cert = ck.cert.der().clone();
            let key =
                PrivateKeyDer::try_from(ck.signing_key.serialize_der()).map_err(|e| format!("generated key: {e}"))?;
            let fingerprint = fingerprint(&cert);
            Ok(ServerIdentity { chain: vec![cert], key, fingerprint, generated: true })
        }
    }
}

/// A rustls server config: the identity, optional client certificates
/// (required when `require_client_cert`), and ALPN.
pub fn server_config(cfg: &TlsConfig, id: &ServerIdentity, alpn: &[&[u8]]) -> Result<rustls::ServerConfig, String> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| e.to_string())?;
    let builder = if cfg.require_client_cert {
        let ca =
            cfg.ca_path.as_ref().ok_or("require_client_cert needs a CA file to check client certificates against")?;
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(load_roots(ca)?), provider())
                .build()
                .map_err(|e| format!("client certificate verifier: {e}"))?;
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let mut c = builder
        .with_single_cert(id.chain.clone(), id.key.clone_key())
        .map_err(|e| format!("server certificate: {e}"))?;
    c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(c)
}

/// Accepts a server whose leaf certificate has one SHA-256 fingerprint,
/// whatever its issuer or names (signatures are still verified); with no
/// pin, any certificate (`insecure_skip_verify_dangerous` only).
#[derive(Debug)]
struct FingerprintVerifier {
    pin: Option<String>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for FingerprintVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(pin) = &self.pin else { return Ok(ServerCertVerified::assertion()) };
        let got = fingerprint(end_entity);
        if &got == pin {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "server certificate fingerprint sha256:{got} does not match the pinned sha256:{pin}"
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(m, c, d, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// TLS settings for a client, with the URL's `?pin-sha256=HEX`,
/// `?ca=PATH` and `?server-name=NAME` applied on top of `cfg`.
pub fn client_tls_for(cfg: &TlsConfig, ep: &Endpoint) -> TlsConfig {
    let mut t = cfg.clone();
    if let Some(p) = ep.query("pin-sha256") {
        t.pin_sha256 = Some(p.to_string());
    }
    if let Some(ca) = ep.query("ca") {
        t.ca_path = Some(ca.into());
    }
    if let Some(n) = ep.query("server-name") {
        t.server_name = Some(n.to_string());
    }
    t
}

/// A rustls client config that verifies the server as `cfg` says.
pub fn client_config(cfg: &TlsConfig, alpn: &[&[u8]]) -> Result<rustls::ClientConfig, String> {
    let p = provider();
    let builder = rustls::ClientConfig::builder_with_provider(p.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| e.to_string())?;
    let builder = if cfg.insecure_skip_verify_dangerous {
        tracing::warn!(
            "TLS certificate verification is OFF (insecure_skip_verify_dangerous): anyone can impersonate the server"
        );
        builder.dangerous().with_custom_certificate_verifier(Arc::new(FingerprintVerifier { pin: None, provider: p }))
    } else if let Some(pin) = &cfg.pin_sha256 {
        let pin = normalize_pin(pin);
        if pin.len() != 64 {
            return Err(format!("pin-sha256 must be 64 hex digits (got {})", pin.len()));
        }
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(FingerprintVerifier { pin: Some(pin), provider: p }))
    } else if let Some(ca) = &cfg.ca_path {
        builder.with_root_certificates(load_roots(ca)?)
    } else {
        let found = rustls_native_certs::load_native_certs();
        let mut roots = RootCertStore::empty();
        let (added, _) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            return Err("no way to verify the server: no system CA certificates found; give a CA file (--ca), a pinned fingerprint (--pin-sha256), or for development only --insecure-dev".into());
        }
        builder.with_root_certificates(roots)
    };
    let mut c = match (&cfg.client_cert_path, &cfg.client_key_path) {
        (Some(c), Some(k)) => builder
            .with_client_auth_cert(load_certs(c)?, load_key(k)?)
            .map_err(|e| format!("client certificate: {e}"))?,
        (None, None) => builder.with_no_client_auth(),
        _ => return Err("give both a client certificate and its key, or neither".into()),
    };
    c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(c)
}

/// Advice to append to a certificate error message, by its cause.
pub fn hint(reason: &str) -> &'static str {
    if reason.contains("UnknownIssuer") {
        "; the server's certificate is not signed by a CA this client trusts: give --ca FILE (TlsConfig::ca_path), or for a self-signed server its fingerprint with --pin-sha256 (printed by the server at start and part of its URL)"
    } else if reason.contains("NotValidForName") || reason.contains("not valid for name") {
        "; the certificate does not name the host in the URL: connect by a name it carries or set --server-name / TlsConfig::server_name"
    } else if reason.contains("Expired") || reason.contains("NotValidYet") {
        "; check the certificate's validity dates and the clocks"
    } else if reason.contains("CertificateRequired") || reason.contains("certificate_required") {
        "; the server requires a client certificate (mutual TLS): give --client-cert and --client-key (TlsConfig::client_cert_path/client_key_path) signed by a CA the server trusts"
    } else if reason.contains("does not match the pinned") {
        "; the server presents a different certificate than the pinned one (restarted with a new self-signed certificate?)"
    } else {
        ""
    }
}

/// The name the server certificate must carry: `server_name`, else the URL host.
pub fn server_name(cfg: &TlsConfig, ep: &Endpoint) -> Result<ServerName<'static>, String> {
    let name = cfg.server_name.clone().unwrap_or_else(|| ep.host().to_string());
    ServerName::try_from(name.clone()).map_err(|e| format!("{name:?} is not a valid server name: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_signed_identity_and_pins() {
        let id = server_identity(&TlsConfig::default(), &["example.test".into()]).unwrap();
        assert!(id.generated);
        assert_eq!(id.fingerprint.len(), 64);
        assert_eq!(normalize_pin(&id.fingerprint.to_uppercase()), id.fingerprint);
        let colons: String =
            id.fingerprint.as_bytes().chunks(2).map(|c| std::str::from_utf8(c).unwrap()).collect::<Vec<_>>().join(":");
        assert_eq!(normalize_pin(&colons), id.fingerprint);
        assert!(server_config(&TlsConfig::default(), &id, &[b"x"]).is_ok());
        let bad = TlsConfig { pin_sha256: Some("abc".into()), ..Default::default() };
        assert!(client_config(&bad, &[]).unwrap_err().contains("64 hex"));
        let half = TlsConfig { cert_path: Some("/nonexistent.pem".into()), ..Default::default() };
        assert!(server_identity(&half, &[]).unwrap_err().contains("both"));
        let missing = TlsConfig {
            cert_path: Some("/nonexistent.pem".into()),
            key_path: Some("/nonexistent.key".into()),
            ..Default::default()
        };
        assert!(server_identity(&missing, &[]).unwrap_err().contains("/nonexistent.pem"));
    }
}
