//! Test certificates: a CA, server and client certificates signed by it, as PEM files.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair};

/// PEM files of one CA and certificates it signed.
pub struct Pki {
    /// The CA certificate.
    pub ca: PathBuf,
    /// Server certificate for `localhost` only (not for 127.0.0.1).
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// Client certificate (clientAuth).
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
}

fn write(dir: &Path, name: &str, pem: String) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, pem).unwrap();
    p
}

/// A fresh CA named `name` and its certificates, written into `dir`.
pub fn pki(dir: &Path, name: &str) -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, format!("tensorwire test CA {name}"));
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();

    let server_key = KeyPair::generate().unwrap();
    let mut sp = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    sp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server = sp.signed_by(&server_key, &ca).unwrap();

    let client_key = KeyPair::generate().unwrap();
    let mut cp = CertificateParams::new(vec!["client.test".to_string()]).unwrap();
    cp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client = cp.signed_by(&client_key, &ca).unwrap();

    Pki {
        ca: write(dir, &format!("{name}-ca.pem"), ca.pem()),
        server_cert: write(dir, &format!("{name}-server.pem"), server.pem()),
        server_key: write(dir, &format!("{name}-server.key"), server_key.serialize_pem()),
        client_cert: write(dir, &format!("{name}-client.pem"), client.pem()),
        client_key: write(dir, &format!("{name}-client.key"), client_key.serialize_pem()),
    }
}
