//! Status codes between tensorwire and gRPC (`tonic::Status`), both ways.

use crate::error::{CallError, Code, Status};

pub(crate) fn to_tonic(s: &Status) -> tonic::Status {
    use tonic::Code as T;
    let code = match s.code {
        Code::InvalidArgument | Code::Protocol | Code::UnsupportedCodec => T::InvalidArgument,
        Code::NotFound => T::NotFound,
        Code::AlreadyExists => T::AlreadyExists,
        Code::PermissionDenied => T::PermissionDenied,
        Code::ResourceExhausted => T::ResourceExhausted,
        Code::FailedPrecondition | Code::UnsupportedVersion => T::FailedPrecondition,
        Code::Cancelled => T::Cancelled,
        Code::DeadlineExceeded => T::DeadlineExceeded,
        Code::Unimplemented => T::Unimplemented,
        Code::Unavailable => T::Unavailable,
        Code::DataLoss => T::DataLoss,
        Code::Unauthenticated => T::Unauthenticated,
        _ => T::Internal,
    };
    tonic::Status::new(code, s.message.clone())
}

pub(crate) fn from_tonic(s: &tonic::Status) -> Status {
    use tonic::Code as T;
    let code = match s.code() {
        T::InvalidArgument | T::OutOfRange => Code::InvalidArgument,
        T::NotFound => Code::NotFound,
        T::AlreadyExists => Code::AlreadyExists,
        T::PermissionDenied => Code::PermissionDenied,
        T::ResourceExhausted => Code::ResourceExhausted,
        T::FailedPrecondition | T::Aborted => Code::FailedPrecondition,
        T::Cancelled => Code::Cancelled,
        T::DeadlineExceeded => Code::DeadlineExceeded,
        T::Unimplemented => Code::Unimplemented,
        T::Unavailable => Code::Unavailable,
        T::DataLoss => Code::DataLoss,
        T::Unauthenticated => Code::Unauthenticated,
        _ => Code::Internal,
    };
    Status::new(code, s.message().to_string())
}

pub(crate) fn call_status(e: CallError) -> tonic::Status {
    to_tonic(&Status::from(e))
}
