//! Rust errors to the `tensorwire` exception hierarchy, which lives in
//! Python (`tensorwire/_errors.py`) so that `TimeoutError` can subclass both
//! `tensorwire.Error` and the builtin, and `ConnectError` the builtin
//! `ConnectionError`: classes made by PyO3 have a single base.

use pyo3::prelude::*;
use pyo3::types::PyTuple;
use tensorwire::{CallError, Code, Status};

/// The module holding the exception classes.
const ERRORS: &str = "tensorwire._errors";

/// Builds `tensorwire.<class>(message, code)`.
pub fn raise(py: Python<'_>, class: &str, message: String, code: Code) -> PyErr {
    let made = py.import(ERRORS).and_then(|m| m.getattr(class)).and_then(|cls| {
        let args = PyTuple::new(
            py,
            [message.clone().into_pyobject(py)?.into_any(), code_name(code).into_pyobject(py)?.into_any()],
        )?;
        cls.call1(args)
    });
    match made {
        Ok(e) => PyErr::from_value(e),
        // The package is broken (no _errors module): still say what failed.
        Err(_) => pyo3::exceptions::PyRuntimeError::new_err(message),
    }
}

/// The Python exception for a failed call.
pub fn call_error(py: Python<'_>, e: CallError) -> PyErr {
    let code = e.code();
    let class = match &e {
        CallError::Connect(_) => "ConnectError",
        CallError::Remote(s) if s.code == Code::DeadlineExceeded => "TimeoutError",
        CallError::Remote(_) => "RemoteError",
        CallError::Timeout(_) => "TimeoutError",
        CallError::Decode(_) => "DecodeError",
        CallError::Stream(s) if s.is_connection_error() => "ConnectError",
        _ => "Error",
    };
    let message = match &e {
        // The status's own message, without the "server error" prefix:
        // Python users see exactly what the handler raised.
        CallError::Remote(s) => s.message.clone(),
        other => other.to_string(),
    };
    raise(py, class, message, code)
}

/// `call_error` for code that does not hold the GIL (futures).
pub fn call_error_nogil(e: CallError) -> PyErr {
    Python::attach(|py| call_error(py, e))
}

/// The status a Python handler's exception becomes on the wire: the
/// exception's type and message; the code follows the builtin type where it
/// says what went wrong (ValueError/TypeError: bad argument, KeyError: not
/// found), and `tensorwire.RemoteError(code=...)` raised by a handler keeps
/// its code.
pub fn handler_status(py: Python<'_>, e: PyErr) -> Status {
    let value = e.value(py);
    let type_name = value.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "Exception".into());
    let text = value.str().map(|s| s.to_string()).unwrap_or_default();
    let message = if text.is_empty() { type_name.clone() } else { format!("{type_name}: {text}") };
    let is = |cls: &str| {
        py.import("builtins")
            .and_then(|b| b.getattr(cls))
            .map(|c| value.is_instance(&c).unwrap_or(false))
            .unwrap_or(false)
    };
    let own_code = py
        .import(ERRORS)
        .and_then(|m| m.getattr("RemoteError"))
        .ok()
        .filter(|c| value.is_instance(c).unwrap_or(false))
        .and_then(|_| value.getattr("code").ok())
        .and_then(|c| c.extract::<String>().ok())
        .and_then(|c| code_from_name(&c));
    if let Some(code) = own_code {
        return Status::new(code, text);
    }
    let code = if is("ValueError") || is("TypeError") {
        Code::InvalidArgument
    } else if is("LookupError") {
        Code::NotFound
    } else if is("NotImplementedError") {
        Code::Unimplemented
    } else if is("TimeoutError") {
        Code::DeadlineExceeded
    } else if is("PermissionError") {
        Code::PermissionDenied
    } else {
        Code::Internal
    };
    Status::new(code, message)
}

/// The code's Python-facing name: `"NOT_FOUND"`, like gRPC's.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Cancelled => "CANCELLED",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Protocol => "PROTOCOL",
        Code::UnsupportedVersion => "UNSUPPORTED_VERSION",
        Code::UnsupportedCodec => "UNSUPPORTED_CODEC",
        Code::Refused => "REFUSED",
        Code::LimitExceeded => "LIMIT_EXCEEDED",
        Code::Unauthenticated => "UNAUTHENTICATED",
        _ => "UNKNOWN",
    }
}

fn code_from_name(name: &str) -> Option<Code> {
    const ALL: [Code; 18] = [
        Code::InvalidArgument,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Cancelled,
        Code::DeadlineExceeded,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Protocol,
        Code::UnsupportedVersion,
        Code::UnsupportedCodec,
        Code::Refused,
        Code::LimitExceeded,
        Code::Unauthenticated,
    ];
    ALL.into_iter().find(|c| code_name(*c) == name)
}
