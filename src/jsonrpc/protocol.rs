//! The JSON-RPC 2.0 envelope, sans-IO: a request body parsed into
//! requests (single or batch, notifications marked), error objects with
//! their codes, and responses. No HTTP and no tensors here; the fuzz target
//! drives this with arbitrary bytes.

use serde_json::{Map, Value as Json, json};

use crate::error::{Code, Status};

/// Invalid JSON.
pub(crate) const PARSE_ERROR: i64 = -32700;
/// Not a valid request object.
pub(crate) const INVALID_REQUEST: i64 = -32600;
/// No such method.
pub(crate) const METHOD_NOT_FOUND: i64 = -32601;
/// Params that do not fit the method.
pub(crate) const INVALID_PARAMS: i64 = -32602;
/// A failure inside the server.
pub(crate) const INTERNAL_ERROR: i64 = -32603;
/// Server errors are `SERVER_ERROR_BASE - <wire ErrorCode>` (-32001 ... -32099).
pub(crate) const SERVER_ERROR_BASE: i64 = -32000;
/// Longest string id a request may carry (every answer echoes it, and an
/// error answer is sent whether or not the response has room left).
pub(crate) const MAX_ID_BYTES: usize = 1024;

/// A JSON-RPC error object.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RpcError {
    pub(crate) code: i64,
    pub(crate) message: String,
    pub(crate) data: Option<Json>,
}

impl RpcError {
    fn new(code: i64, message: impl Into<String>) -> Self {
        Self { code, message: message.into(), data: None }
    }

    pub(crate) fn parse(message: impl Into<String>) -> Self {
        Self::new(PARSE_ERROR, message)
    }

    pub(crate) fn invalid_request(message: impl Into<String>) -> Self {
        Self::new(INVALID_REQUEST, message)
    }

    pub(crate) fn method_not_found(message: impl Into<String>) -> Self {
        Self::new(METHOD_NOT_FOUND, message)
    }

    pub(crate) fn invalid_params(message: impl Into<String>) -> Self {
        Self::new(INVALID_PARAMS, message)
    }

    /// A server status as an error object: INVALID_ARGUMENT is "invalid
    /// params", INTERNAL "internal error", every other code
    /// `-32000 - <wire code>`; `data` names the status code either way.
    pub(crate) fn from_status(s: &Status) -> Self {
        let code = match s.code {
            Code::InvalidArgument => INVALID_PARAMS,
            Code::Internal => INTERNAL_ERROR,
            other => SERVER_ERROR_BASE - i64::from(other.to_wire() as i32),
        };
        Self { code, message: s.to_string(), data: Some(json!({ "status": s.code.name(), "message": s.message })) }
    }

    pub(crate) fn to_json(&self) -> Json {
        let mut e = Map::new();
        e.insert("code".into(), Json::from(self.code));
        e.insert("message".into(), Json::from(self.message.clone()));
        if let Some(d) = &self.data {
            e.insert("data".into(), d.clone());
        }
        Json::Object(e)
    }
}

/// A request's params.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Params {
    /// No `params` member.
    None,
    /// `"params": [...]`
    Positional(Vec<Json>),
    /// `"params": {...}`
    Named(Map<String, Json>),
}

/// One valid request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Request {
    /// None for a notification (no `id` member): run, never answered.
    pub(crate) id: Option<Json>,
    pub(crate) method: String,
    pub(crate) params: Params,
}

/// One entry of a body: a request, or the error to answer it with (and
/// the id to answer with: the request's when it could be read, else null).
pub(crate) type Entry = Result<Request, Box<(Json, RpcError)>>;

/// A parsed body.
#[derive(Debug)]
pub(crate) enum Body {
    /// One request object.
    Single(Entry),
    /// A batch (a non-empty array), answered by an array.
    Batch(Vec<Entry>),
    /// Not JSON, an empty batch, or a batch above the limit: one error, id null.
    Invalid(RpcError),
}

/// About how many JSON values `body` holds, counted without parsing it
/// (one per `[`, `{`, `,` and `:` outside strings, plus one): what its
/// parse will allocate is bounded by this times a value's size, so the
/// server reserves memory for a body before parsing it.
pub(crate) fn json_values(body: &[u8]) -> u64 {
    let (mut n, mut in_string, mut escaped) = (1u64, false, false);
    for &b in body {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else {
            match b {
                b'"' => in_string = true,
                b'[' | b'{' | b',' | b':' => n += 1,
                _ => {}
            }
        }
    }
    n
}

/// Parses a request body; batches may hold at most `max_batch` requests.
pub(crate) fn parse(body: &[u8], max_batch: usize) -> Body {
    let v: Json = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return Body::Invalid(RpcError::parse(format!("Parse error: {e}"))),
    };
    match v {
        Json::Array(items) if items.is_empty() => {
            Body::Invalid(RpcError::invalid_request("Invalid Request: empty batch"))
        }
        Json::Array(items) if items.len() > max_batch => Body::Invalid(RpcError::invalid_request(format!(
            "Invalid Request: a batch of {} requests is above the limit of {max_batch}",
            items.len()
        ))),
        Json::Array(items) => Body::Batch(items.into_iter().map(entry).collect()),
        other => Body::Single(entry(other)),
    }
}

fn entry(v: Json) -> Entry {
    let Json::Object(mut o) = v else {
        return Err(Box::new((Json::Null, RpcError::invalid_request("Invalid Request: a request must be an object"))));
    };
    let id = match o.remove("id") {
        None => None,
        Some(Json::String(s)) if s.len() > MAX_ID_BYTES => {
            let e = RpcError::invalid_request(format!(
                "Invalid Request: an id of {} bytes (at most {MAX_ID_BYTES})",
                s.len()
            ));
            return Err(Box::new((Json::Null, e)));
        }
        Some(id @ (Json::String(_) | Json::Number(_) | Json::Null)) => Some(id),
        Some(_) => {
            let e = RpcError::invalid_request("Invalid Request: id must be a string, a number or null");
            return Err(Box::new((Json::Null, e)));
        }
    };
    let answer_id = id.clone().unwrap_or(Json::Null);
    let bad = |m: &str| Err(Box::new((answer_id.clone(), RpcError::invalid_request(format!("Invalid Request: {m}")))));
    if o.get("jsonrpc").and_then(Json::as_str) != Some("2.0") {
        return bad("\"jsonrpc\" must be \"2.0\"");
    }
    let method = match o.remove("method") {
        Some(Json::String(m)) => m,
        Some(_) => return bad("method must be a string"),
        None => return bad("no method"),
    };
    let params = match o.remove("params") {
        None => Params::None,
        Some(Json::Array(a)) => Params::Positional(a),
        Some(Json::Object(m)) => Params::Named(m),
        Some(_) => return bad("params must be an array or an object"),
    };
    Ok(Request { id, method, params })
}

/// A response object.
pub(crate) fn response(id: Json, result: Result<Json, RpcError>) -> Json {
    match result {
        Ok(r) => json!({ "jsonrpc": "2.0", "result": r, "id": id }),
        Err(e) => json!({ "jsonrpc": "2.0", "error": e.to_json(), "id": id }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_ids_are_refused() {
        let long = "x".repeat(MAX_ID_BYTES + 1);
        let Body::Single(Err(bad)) =
            parse(json!({"jsonrpc": "2.0", "method": "m", "id": long}).to_string().as_bytes(), 4)
        else {
            panic!("a long id is an invalid request");
        };
        assert_eq!((bad.0.clone(), bad.1.code), (Json::Null, INVALID_REQUEST));
        let fine = "x".repeat(MAX_ID_BYTES);
        assert!(matches!(
            parse(json!({"jsonrpc": "2.0", "method": "m", "id": fine}).to_string().as_bytes(), 4),
            Body::Single(Ok(_))
        ));
    }

    #[test]
    fn values_are_counted_without_parsing() {
        assert_eq!(json_values(b"30"), 1);
        assert_eq!(json_values(b"[0,0,0]"), 4);
        assert_eq!(json_values(br#"{"a":[1,2],"b":{}}"#), 8);
        // Structure inside strings (escaped quotes too) is not counted.
        assert_eq!(json_values(br#"["a,b:[{", "x\"],[\\"]"#), 3);
        // An upper bound on the values a parse makes, for any text.
        let parsed = |b: &[u8]| serde_json::from_slice::<Json>(b).unwrap();
        assert_eq!(parsed(br#"["a,b:[{", "x\"],[\\"]"#).as_array().unwrap().len(), 2);
    }

    fn single(body: &str) -> Entry {
        match parse(body.as_bytes(), 10) {
            Body::Single(e) => e,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn requests_and_notifications() {
        let r = single(r#"{"jsonrpc":"2.0","method":"add","params":[1,2],"id":7}"#).unwrap();
        assert_eq!((r.id, r.method.as_str()), (Some(json!(7)), "add"));
        assert_eq!(r.params, Params::Positional(vec![json!(1), json!(2)]));
        let n = single(r#"{"jsonrpc":"2.0","method":"ping"}"#).unwrap();
        assert_eq!((n.id, n.params), (None, Params::None));
        let null_id = single(r#"{"jsonrpc":"2.0","method":"x","id":null}"#).unwrap();
        assert_eq!(null_id.id, Some(Json::Null), "a null id is a request, not a notification");
    }

    #[test]
    fn every_invalid_form_has_its_code() {
        assert!(matches!(parse(b"{\"jsonrpc\": \"2.0\", \"method\"", 10), Body::Invalid(e) if e.code == PARSE_ERROR));
        assert!(matches!(parse(b"[]", 10), Body::Invalid(e) if e.code == INVALID_REQUEST));
        assert!(matches!(parse(b"[1,1,1]", 2), Body::Invalid(e) if e.code == INVALID_REQUEST));
        for (body, id) in [
            (r#"{"jsonrpc":"1.0","method":"x","id":1}"#, json!(1)),
            (r#"{"jsonrpc":"2.0","method":3,"id":"a"}"#, json!("a")),
            (r#"{"jsonrpc":"2.0","method":"x","params":5,"id":2}"#, json!(2)),
            (r#"{"jsonrpc":"2.0","method":"x","id":[1]}"#, Json::Null),
            (r#"{"foo":"boo"}"#, Json::Null),
            (r#"1"#, Json::Null),
        ] {
            let (got_id, e) = *single(body).unwrap_err();
            assert_eq!((e.code, got_id), (INVALID_REQUEST, id), "{body}");
        }
        let Body::Batch(b) = parse(br#"[1, {"jsonrpc":"2.0","method":"m"}]"#, 10) else { panic!() };
        assert!(b[0].is_err() && b[1].is_ok());
    }

    #[test]
    fn statuses_map_to_codes() {
        let e = RpcError::from_status(&Status::not_found("no task"));
        assert_eq!(e.code, -32002);
        assert_eq!(e.data.as_ref().unwrap()["status"], "NOT_FOUND");
        assert_eq!(RpcError::from_status(&Status::invalid_argument("x")).code, INVALID_PARAMS);
        assert_eq!(RpcError::from_status(&Status::unauthenticated("x")).code, -32018);
        let r = response(json!(1), Err(e));
        assert_eq!(r["error"]["code"], -32002);
        assert_eq!(r["jsonrpc"], "2.0");
    }
}
