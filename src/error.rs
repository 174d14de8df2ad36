//! Errors: [`Status`] is what a handler returns and what travels to the peer
//! in an `Error` frame; [`CallError`] is what a client call returns.

use std::fmt;
use std::time::Duration;

use tensorwire_codecs::{DecodeError, EncodeError};
use tensorwire_proto::v1;
use tensorwire_transports::{ConnectError, StreamError};

/// Error codes carried to the peer (gRPC's, plus protocol-specific ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Code {
    /// Bad argument from the caller.
    InvalidArgument,
    /// No such tensor, function or task.
    NotFound,
    /// It exists already.
    AlreadyExists,
    /// Not allowed.
    PermissionDenied,
    /// Out of memory, queue full, too many tasks.
    ResourceExhausted,
    /// The system is not in a state for this call.
    FailedPrecondition,
    /// Cancelled by the caller or the server.
    Cancelled,
    /// The deadline passed.
    DeadlineExceeded,
    /// The server does not implement this.
    Unimplemented,
    /// A bug or unexpected failure in the handler.
    Internal,
    /// The service is shutting down or unreachable.
    Unavailable,
    /// Data was lost or corrupted (checksum mismatch).
    DataLoss,
    /// The peer broke the protocol.
    Protocol,
    /// The peer speaks another protocol version.
    UnsupportedVersion,
    /// A codec or compression the receiver does not accept.
    UnsupportedCodec,
    /// The call was not processed at all; safe to retry.
    Refused,
    /// A size or count above the receiver's limit.
    LimitExceeded,
    /// Missing or wrong credentials.
    Unauthenticated,
    /// Anything else.
    Unknown,
}

impl Code {
    /// The code's wire value.
    pub fn to_wire(self) -> v1::ErrorCode {
        use v1::ErrorCode as E;
        match self {
            Code::InvalidArgument => E::InvalidArgument,
            Code::NotFound => E::NotFound,
            Code::AlreadyExists => E::AlreadyExists,
            Code::PermissionDenied => E::PermissionDenied,
            Code::ResourceExhausted => E::ResourceExhausted,
            Code::FailedPrecondition => E::FailedPrecondition,
            Code::Cancelled => E::Cancelled,
            Code::DeadlineExceeded => E::DeadlineExceeded,
            Code::Unimplemented => E::Unimplemented,
            Code::Internal => E::Internal,
            Code::Unavailable => E::Unavailable,
            Code::DataLoss => E::DataLoss,
            Code::Protocol => E::Protocol,
            Code::UnsupportedVersion => E::UnsupportedVersion,
            Code::UnsupportedCodec => E::UnsupportedCodec,
            Code::Refused => E::Refused,
            Code::LimitExceeded => E::LimitExceeded,
            Code::Unauthenticated => E::Unauthenticated,
            Code::Unknown => E::Unspecified,
        }
    }

    /// The code for a wire value (unknown values become [`Code::Unknown`]).
    pub fn from_wire(v: i32) -> Code {
        use v1::ErrorCode as E;
        match E::try_from(v).unwrap_or(E::Unspecified) {
            E::InvalidArgument => Code::InvalidArgument,
            E::NotFound => Code::NotFound,
            E::AlreadyExists => Code::AlreadyExists,
            E::PermissionDenied => Code::PermissionDenied,
            E::ResourceExhausted => Code::ResourceExhausted,
            E::FailedPrecondition => Code::FailedPrecondition,
            E::Cancelled => Code::Cancelled,
            E::DeadlineExceeded => Code::DeadlineExceeded,
            E::Unimplemented => Code::Unimplemented,
            E::Internal => Code::Internal,
            E::Unavailable => Code::Unavailable,
            E::DataLoss => Code::DataLoss,
            E::Protocol => Code::Protocol,
            E::UnsupportedVersion => Code::UnsupportedVersion,
            E::UnsupportedCodec => Code::UnsupportedCodec,
            E::Refused => Code::Refused,
            E::LimitExceeded => Code::LimitExceeded,
            E::Unauthenticated => Code::Unauthenticated,
            E::Unspecified => Code::Unknown,
        }
    }

    /// SCREAMING_CASE name, as in messages.
    pub fn name(self) -> &'static str {
        match self {
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
            Code::Unknown => "UNKNOWN",
        }
    }
}

/// An error with a code and a message: what handlers return, and what the
/// peer receives in an `Error` frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// The code.
    pub code: Code,
    /// Human-readable message.
    pub message: String,
}

macro_rules! ctor {
    ($($name:ident => $code:ident),* $(,)?) => {
        $(
            #[doc = concat!("A `", stringify!($code), "` status.")]
            pub fn $name(message: impl Into<String>) -> Self {
                Self::new(Code::$code, message)
            }
        )*
    };
}

impl Status {
    /// A status with `code` and `message`.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    ctor! {
        invalid_argument => InvalidArgument,
        not_found => NotFound,
        already_exists => AlreadyExists,
        permission_denied => PermissionDenied,
        resource_exhausted => ResourceExhausted,
        failed_precondition => FailedPrecondition,
        cancelled => Cancelled,
        deadline_exceeded => DeadlineExceeded,
        unimplemented => Unimplemented,
        internal => Internal,
        unavailable => Unavailable,
        data_loss => DataLoss,
        protocol => Protocol,
        unsupported_codec => UnsupportedCodec,
        refused => Refused,
        limit_exceeded => LimitExceeded,
        unauthenticated => Unauthenticated,
    }

    /// The wire message.
    pub fn to_wire(&self) -> v1::Error {
        v1::Error { code: self.code.to_wire() as i32, message: self.message.clone() }
    }

    /// From the wire message.
    pub fn from_wire(e: &v1::Error) -> Self {
        Self { code: Code::from_wire(e.code), message: e.message.clone() }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.name(), self.message)
    }
}

impl std::error::Error for Status {}

impl From<DecodeError> for Status {
    fn from(e: DecodeError) -> Self {
        let code = match &e {
            DecodeError::TooLarge { .. } | DecodeError::TooManyDims { .. } | DecodeError::LimitExceeded { .. } => {
                Code::LimitExceeded
            }
            DecodeError::UnknownCodec(_) | DecodeError::NotEnabled(_) => Code::UnsupportedCodec,
            DecodeError::Checksum { .. } => Code::DataLoss,
            DecodeError::ForbiddenGlobal { .. } => Code::PermissionDenied,
            _ => Code::InvalidArgument,
        };
        Status::new(code, e.to_string())
    }
}

impl From<tensorwire_codecs::TensorError> for Status {
    fn from(e: tensorwire_codecs::TensorError) -> Self {
        Status::invalid_argument(e.to_string())
    }
}

impl From<EncodeError> for Status {
    fn from(e: EncodeError) -> Self {
        Status::invalid_argument(e.to_string())
    }
}

/// Errors of a client call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// Could not (re)connect.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The server answered with an error (its handler's, or a refusal).
    #[error("server error {0}")]
    Remote(Status),
    /// The stream or connection failed during the call.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// The peer sent something that breaks the protocol.
    #[error("protocol violation by {peer}: {reason}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What it did.
        reason: String,
    },
    /// A received payload failed to decode.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// A tensor failed to encode (e.g. a dtype the codec lacks).
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// Something above a limit, before anything was sent or allocated.
    #[error("{what} of {size} exceeds the limit of {limit}")]
    Limit {
        /// What.
        what: &'static str,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// Memory for what was received (or is to be received) could not be
    /// had: the memory budget is spent or the allocator failed. Nothing of
    /// the tensor was kept.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// The call took longer than its timeout.
    #[error("call timed out after {0:?}")]
    Timeout(Duration),
    /// The call needs something the server or this build does not offer.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// API misuse (a bad argument on this side).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl CallError {
    /// A copy of this error, for reporting one failure to several callers
    /// (errors that hold an I/O error become their message).
    pub fn duplicate(&self) -> CallError {
        match self {
            CallError::Remote(s) => CallError::Remote(s.clone()),
            CallError::Stream(e) => CallError::Stream(e.clone()),
            CallError::Protocol { peer, reason } => CallError::Protocol { peer: peer.clone(), reason: reason.clone() },
            CallError::Decode(e) => CallError::Decode(e.clone()),
            CallError::Limit { what, size, limit } => CallError::Limit { what, size: *size, limit: *limit },
            CallError::Timeout(d) => CallError::Timeout(*d),
            CallError::OutOfMemory(m) => CallError::OutOfMemory(m.clone()),
            CallError::Unsupported(m) => CallError::Unsupported(m.clone()),
            CallError::InvalidArgument(m) => CallError::InvalidArgument(m.clone()),
            CallError::Connect(e) => CallError::Remote(Status::unavailable(e.to_string())),
            CallError::Encode(e) => CallError::InvalidArgument(e.to_string()),
        }
    }

    /// The remote status, if the server sent one.
    pub fn status(&self) -> Option<&Status> {
        match self {
            CallError::Remote(s) => Some(s),
            _ => None,
        }
    }

    /// The code a server would see for this error.
    pub fn code(&self) -> Code {
        match self {
            CallError::Remote(s) => s.code,
            CallError::Connect(_) => Code::Unavailable,
            CallError::Stream(e) if e.is_connection_error() => Code::Unavailable,
            CallError::Stream(StreamError::ResourceExhausted { .. }) => Code::ResourceExhausted,
            CallError::Stream(StreamError::LimitExceeded { .. }) => Code::LimitExceeded,
            CallError::Stream(_) => Code::Cancelled,
            CallError::Protocol { .. } => Code::Protocol,
            CallError::Decode(e) => Status::from(e.clone()).code,
            CallError::Encode(_) | CallError::InvalidArgument(_) => Code::InvalidArgument,
            CallError::Limit { .. } => Code::LimitExceeded,
            CallError::OutOfMemory(_) => Code::ResourceExhausted,
            CallError::Timeout(_) => Code::DeadlineExceeded,
            CallError::Unsupported(_) => Code::Unimplemented,
        }
    }
}

impl From<CallError> for Status {
    fn from(e: CallError) -> Self {
        match e {
            CallError::Remote(s) => s,
            other => Status::new(other.code(), other.to_string()),
        }
    }
}
