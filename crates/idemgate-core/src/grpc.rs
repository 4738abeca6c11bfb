//! gRPC as the gateway meets it: HTTP/2 requests whose body is a sequence
//! of length-prefixed messages and whose status travels in trailers
//! (gRPC's "PROTOCOL-HTTP2" document). This module knows the wire details
//! every layer needs — which request is a gRPC call, its deadline, how
//! many messages its body holds, what its `grpc-status` is — and turns the
//! gateway's own refusals into answers a gRPC client can read: a bare
//! HTTP `409` or `503` reaches a gRPC application as `UNKNOWN` or
//! `UNAVAILABLE` with the reason lost, so each refusal becomes a
//! trailers-only answer (HTTP `200`, `grpc-status`, `grpc-message`).

use std::time::Duration;

use axum::body::Body;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};

use crate::error::{PROBLEM_TYPE_PREFIX, ProblemReason, Reason};

/// `grpc-status`: the call's status code, in the trailers (or the headers
/// of a trailers-only answer).
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// `grpc-message`: the status's message, percent-encoded.
pub const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// `grpc-timeout`: the client's deadline for the call.
pub const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// The gRPC status codes the gateway reads or answers with (the numbers
/// are the wire values; gRPC's `statuscodes.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
#[allow(missing_docs)] // the names are gRPC's own
pub enum Code {
    Ok = 0,
    Cancelled = 1,
    Unknown = 2,
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    NotFound = 5,
    AlreadyExists = 6,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Aborted = 10,
    OutOfRange = 11,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    DataLoss = 15,
    Unauthenticated = 16,
}

/// Whether a request is a gRPC call: `content-type: application/grpc`,
/// alone or with a `+codec` or parameters. gRPC-Web (`application/grpc-web`)
/// is not: its trailers travel in the body, so it is plain HTTP here.
/// Any of several `content-type` values counts, as gRPC servers read
/// them: a request the service takes for a gRPC call is one here too.
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONTENT_TYPE)
        .iter()
        .any(|v| is_grpc_type(v.as_bytes()))
}

fn is_grpc_type(value: &[u8]) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    value.len() >= GRPC.len()
        && value[..GRPC.len()].eq_ignore_ascii_case(GRPC)
        && matches!(value.get(GRPC.len()), None | Some(b'+' | b';' | b' '))
}

/// The call's `grpc-timeout` (`TimeoutValue TimeoutUnit`: at most eight
/// digits, then `H`, `M`, `S`, `m`, `u` or `n`): the shortest well-formed
/// value when several are sent; `None` when there is none.
pub fn timeout(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get_all(GRPC_TIMEOUT)
        .iter()
        .filter_map(|v| parse_timeout(v.as_bytes()))
        .min()
}

fn parse_timeout(text: &[u8]) -> Option<Duration> {
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let value: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b"H" => Duration::from_secs(value * 3600),
        b"M" => Duration::from_secs(value * 60),
        b"S" => Duration::from_secs(value),
        b"m" => Duration::from_millis(value),
        b"u" => Duration::from_micros(value),
        b"n" => Duration::from_nanos(value),
        _ => return None,
    })
}

/// `limit` as a `grpc-timeout` value, in the finest unit whose value fits
/// eight digits, rounded down: the service must give up no later than the
/// gateway stops waiting for it.
pub fn timeout_value(limit: Duration) -> HeaderValue {
    const MAX: u128 = 99_999_999;
    let units: [(u128, char); 6] = [
        (limit.as_nanos(), 'n'),
        (limit.as_micros(), 'u'),
        (limit.as_millis(), 'm'),
        (u128::from(limit.as_secs()), 'S'),
        (u128::from(limit.as_secs() / 60), 'M'),
        (u128::from(limit.as_secs() / 3600), 'H'),
    ];
    let (value, unit) = units
        .into_iter()
        .find(|(value, _)| *value <= MAX)
        .unwrap_or((MAX, 'H'));
    HeaderValue::from_str(&format!("{value}{unit}")).unwrap_or(HeaderValue::from_static("1S"))
}

/// How many length-prefixed messages `body` holds (each a flag byte, a
/// four-byte big-endian length, then the message); `None` when the bytes
/// are not such a sequence.
pub fn message_count(body: &[u8]) -> Option<usize> {
    let mut rest = body;
    let mut count = 0;
    while !rest.is_empty() {
        let prefix = rest.get(..5)?;
        let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
        rest = rest.get(5..)?.get(len..)?;
        count += 1;
    }
    Some(count)
}

/// The `grpc-status` in `headers` (trailers, or a trailers-only answer's
/// headers), if there is exactly one and it is well-formed: several
/// values say two things at once, and clients differ on which they read.
pub fn status(headers: &HeaderMap) -> Option<u32> {
    let mut values = headers.get_all(GRPC_STATUS).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    value.to_str().ok()?.parse().ok()
}

/// The status a gRPC client gets for the gateway's own refusal: chosen so
/// that a generic retry policy (which retries `UNAVAILABLE`) retries what
/// may be retried with the same key — the gateway makes such a retry
/// safe — and stops on what no retry can change. An answer that says the
/// call may have run keeps gRPC's own words for that (`DEADLINE_EXCEEDED`,
/// `UNKNOWN`). The table is in `docs/grpc.md`.
pub fn code_for(reason: Reason) -> Code {
    use Reason as R;
    match reason {
        R::UpstreamTimeout | R::HandlerTimeout => Code::DeadlineExceeded,
        R::UpstreamBroken | R::HandlerPanicked => Code::Unknown,
        R::RouteNotFound | R::MethodNotAllowed | R::StreamingCall => Code::Unimplemented,
        R::IdempotencyKeyReused | R::BusinessKeyReused | R::IdempotencyKeyExpired => {
            Code::FailedPrecondition
        }
        R::BodyTooLarge => Code::ResourceExhausted,
        other => match other.status() {
            StatusCode::BAD_REQUEST => Code::InvalidArgument,
            StatusCode::UNAUTHORIZED => Code::Unauthenticated,
            StatusCode::FORBIDDEN => Code::PermissionDenied,
            // In flight, held, rate-limited, out of room, unreachable,
            // a holder lost: nothing new ran, and the same key is safe
            // to send again.
            _ => Code::Unavailable,
        },
    }
}

/// `text` as a `grpc-message` value: percent-encoded, every byte outside
/// printable ASCII and `%` itself.
pub fn message_value(text: &str) -> HeaderValue {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    HeaderValue::from_str(&out).unwrap_or(HeaderValue::from_static("idemgate"))
}

/// The gateway's own refusal (a response carrying [`ProblemReason`]) as
/// a trailers-only gRPC answer: HTTP `200`, `content-type:
/// application/grpc`, `grpc-status` from [`code_for`], `grpc-message`
/// naming the problem type and its title, no body. Every other header
/// (`Retry-After`, `Idempotency-Expires`, `X-Request-Id`) stays, as
/// metadata; so do the extensions the layers above read. `route`, when
/// the request reached one, is named in the message. Any other response
/// is returned unchanged.
pub fn refusal_as_grpc(response: Response<Body>, route: Option<&str>) -> Response<Body> {
    let Some(ProblemReason(reason)) = response.extensions().get::<ProblemReason>().copied() else {
        return response;
    };
    let (mut parts, _) = response.into_parts();
    parts.status = StatusCode::OK;
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    parts
        .headers
        .insert(GRPC_STATUS, HeaderValue::from(code_for(reason) as u16));
    parts.headers.insert(
        GRPC_MESSAGE,
        message_value(&match route {
            Some(route) => format!(
                "{PROBLEM_TYPE_PREFIX}{}: {} (route {route})",
                reason.slug(),
                reason.title()
            ),
            None => format!("{PROBLEM_TYPE_PREFIX}{}: {}", reason.slug(), reason.title()),
        }),
    );
    Response::from_parts(parts, Body::empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Problem;

    #[test]
    fn grpc_calls_are_told_by_their_content_type() {
        let with = |ct: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
            is_grpc(&h)
        };
        assert!(with("application/grpc"));
        assert!(with("application/grpc+proto"));
        assert!(with("Application/GRPC; charset=utf-8"));
        assert!(!with("application/grpc-web"));
        assert!(!with("application/grpc-web+proto"));
        assert!(!with("application/json"));
        let mut two = HeaderMap::new();
        two.append(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        two.append(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        assert!(is_grpc(&two), "any value counts, as the service reads it");
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn grpc_timeouts_are_read_in_every_unit_and_written_within_eight_digits() {
        let read = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(GRPC_TIMEOUT, HeaderValue::from_static(v));
            timeout(&h)
        };
        assert_eq!(read("1H"), Some(Duration::from_secs(3600)));
        let mut two = HeaderMap::new();
        two.append(GRPC_TIMEOUT, HeaderValue::from_static("1S"));
        two.append(GRPC_TIMEOUT, HeaderValue::from_static("1H"));
        assert_eq!(timeout(&two), Some(Duration::from_secs(1)), "the shortest");
        assert_eq!(read("2M"), Some(Duration::from_secs(120)));
        assert_eq!(read("3S"), Some(Duration::from_secs(3)));
        assert_eq!(read("250m"), Some(Duration::from_millis(250)));
        assert_eq!(read("7u"), Some(Duration::from_micros(7)));
        assert_eq!(read("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "S", "123456789m", "1.5S", "10x", "-1S"] {
            assert_eq!(read(bad), None, "{bad:?}");
        }
        assert_eq!(timeout_value(Duration::from_millis(20)), "20000000n");
        assert_eq!(timeout_value(Duration::from_secs(8)), "8000000u");
        assert_eq!(timeout_value(Duration::from_secs(1000)), "1000000m");
        assert_eq!(
            timeout_value(Duration::from_secs(86_400 * 365)),
            "31536000S"
        );
    }

    #[test]
    fn messages_are_counted_by_their_length_prefixes() {
        let msg = |payload: &[u8]| {
            let mut m = vec![0];
            m.extend((payload.len() as u32).to_be_bytes());
            m.extend(payload);
            m
        };
        assert_eq!(message_count(&[]), Some(0));
        assert_eq!(message_count(&msg(b"")), Some(1));
        assert_eq!(message_count(&msg(b"order-1")), Some(1));
        assert_eq!(message_count(&[msg(b"a"), msg(b"bc")].concat()), Some(2));
        assert_eq!(message_count(&msg(b"abc")[..6]), None, "cut short");
        assert_eq!(message_count(&[0, 0, 0]), None, "no whole prefix");
    }

    #[test]
    fn a_refusal_becomes_a_trailers_only_answer_with_its_retry_after() {
        let refusal = Problem::new(Reason::RequestInFlight)
            .retry_after(1)
            .into_response();
        let answer = refusal_as_grpc(refusal, Some("orders"));
        assert_eq!(answer.status(), StatusCode::OK);
        let h = answer.headers();
        assert_eq!(h[header::CONTENT_TYPE], "application/grpc");
        assert_eq!(h[GRPC_STATUS], "14");
        assert_eq!(
            h[GRPC_MESSAGE],
            "urn:idemgate:problem:request-in-flight: A request with this idempotency key is still being processed (route orders)"
        );
        assert_eq!(h[header::RETRY_AFTER], "1");
        assert!(answer.extensions().get::<ProblemReason>().is_some());
        assert!(http_body::Body::is_end_stream(answer.body()));
        let plain = Response::new(Body::from("ok"));
        assert_eq!(refusal_as_grpc(plain, None).status(), StatusCode::OK);
    }

    #[test]
    fn every_reason_has_a_status_a_retry_policy_reads_right() {
        assert_eq!(
            code_for(Reason::IdempotencyKeyMissing),
            Code::InvalidArgument
        );
        assert_eq!(
            code_for(Reason::IdempotencyKeyReused),
            Code::FailedPrecondition
        );
        assert_eq!(code_for(Reason::StoreUnavailable), Code::Unavailable);
        assert_eq!(code_for(Reason::OutcomeUncertain), Code::Unavailable);
        assert_eq!(code_for(Reason::TokenRateLimited), Code::Unavailable);
        assert_eq!(code_for(Reason::UpstreamTimeout), Code::DeadlineExceeded);
        assert_eq!(code_for(Reason::UpstreamBroken), Code::Unknown);
        assert_eq!(code_for(Reason::IdentityInvalid), Code::Unauthenticated);
        assert_eq!(code_for(Reason::StreamingCall), Code::Unimplemented);
        assert_eq!(message_value("a%b\né"), "a%25b%0A%C3%A9");
    }
}
