//! Error mapping: quinn's handshake and connection errors into this crate's,
//! with TLS alert names.

use std::time::Duration;

use crate::{ConnectError, StreamError, tls};

/// TLS alert names for the crypto error codes a QUIC handshake ends with.
fn alert_name(code: u8) -> &'static str {
    match code {
        40 => "handshake_failure",
        42 => "bad_certificate",
        43 => "unsupported_certificate",
        44 => "certificate_revoked",
        45 => "certificate_expired",
        46 => "certificate_unknown",
        48 => "unknown_ca",
        51 => "decrypt_error",
        70 => "protocol_version",
        80 => "internal_error",
        116 => "certificate_required (the server requires a client certificate)",
        120 => "no_application_protocol (the server does not speak tensorwire/1)",
        _ => "TLS alert",
    }
}

pub(crate) fn handshake_error(name: &str, e: quinn::ConnectionError, timeout: Duration) -> ConnectError {
    let tls = |reason: String| ConnectError::Tls { endpoint: name.to_string(), reason };
    match e {
        // Raised here: our verifier refused the server (reason says why).
        quinn::ConnectionError::TransportError(t) => {
            let code = u64::from(t.code);
            if (0x100..0x200).contains(&code) {
                tls(format!("{} [TLS alert {}]{}", t.reason, alert_name((code & 0xff) as u8), tls::hint(&t.reason)))
            } else {
                tls(t.to_string())
            }
        }
        // Raised by the server: it refused us.
        quinn::ConnectionError::ConnectionClosed(c) => {
            let code = u64::from(c.error_code);
            if (0x100..0x200).contains(&code) {
                let alert = (code & 0xff) as u8;
                let why = String::from_utf8_lossy(&c.reason).into_owned();
                tls(format!(
                    "the server refused the handshake: alert {alert} {}{}",
                    alert_name(alert),
                    if why.is_empty() { String::new() } else { format!(": {why}") }
                ))
            } else {
                ConnectError::Protocol { endpoint: name.to_string(), reason: c.to_string() }
            }
        }
        quinn::ConnectionError::TimedOut => ConnectError::Timeout { endpoint: name.to_string(), after: timeout },
        quinn::ConnectionError::VersionMismatch => {
            ConnectError::Protocol { endpoint: name.to_string(), reason: "no common QUIC version".into() }
        }
        other => ConnectError::Io { endpoint: name.to_string(), source: std::io::Error::other(other.to_string()) },
    }
}

pub(crate) fn conn_error(peer: &str, e: &quinn::ConnectionError) -> StreamError {
    let reason = match e {
        quinn::ConnectionError::ApplicationClosed(c) => {
            format!("closed by the peer: {}", String::from_utf8_lossy(&c.reason))
        }
        quinn::ConnectionError::TimedOut => "idle timeout: nothing heard from the peer".to_string(),
        quinn::ConnectionError::ConnectionClosed(c) if (0x100..0x200).contains(&u64::from(c.error_code)) => {
            let alert = (u64::from(c.error_code) & 0xff) as u8;
            format!("the peer ended the TLS handshake: alert {alert} {}", alert_name(alert))
        }
        quinn::ConnectionError::TransportError(t) if (0x100..0x200).contains(&u64::from(t.code)) => {
            format!("TLS failed: {}{}", t.reason, tls::hint(&t.reason))
        }
        quinn::ConnectionError::Reset => "reset by the peer (it restarted or forgot the connection)".to_string(),
        quinn::ConnectionError::LocallyClosed => "closed locally".to_string(),
        other => other.to_string(),
    };
    StreamError::ConnectionClosed { peer: peer.to_string(), reason }
}
