//! Reading bodies the engine must hold: the request (to fingerprint and
//! replay it to the upstream) and the response (to store it).

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::request::Parts;
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};

/// Why a request body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("request body over {limit} bytes")]
    TooLarge { limit: u64 },
    #[error("reading the request body failed: {0}")]
    Broken(String),
}

/// Reads the request body (at most `limit` bytes), hashing it as it
/// arrives: fingerprint = SHA-256 over method, path and query, and body.
pub async fn read_and_fingerprint(
    parts: &Parts,
    body: Body,
    limit: u64,
) -> Result<(Bytes, String), BodyError> {
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(BodyError::TooLarge { limit });
    }
    let mut hash = Sha256::new();
    hash.update(parts.method.as_str().as_bytes());
    hash.update([0]);
    let target = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    hash.update(target.as_bytes());
    hash.update([0]);
    let mut buffer = BytesMut::with_capacity(declared.unwrap_or(0) as usize);
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BodyError::Broken(e.to_string()))?;
        if (buffer.len() + chunk.len()) as u64 > limit {
            return Err(BodyError::TooLarge { limit });
        }
        hash.update(&chunk);
        buffer.extend_from_slice(&chunk);
    }
    Ok((buffer.freeze(), hex::encode(hash.finalize())))
}

/// The fingerprint of a request identified by its business key (a
/// callback, a message) rather than by its bytes: the key and the values
/// of the `must_match` fields (`None`: absent), so that a redelivery
/// re-stamped with a new timestamp or attempt counter is the same request,
/// and one whose amount changed is not. A domain of its own: never equal
/// to a whole-request fingerprint.
pub fn key_fingerprint<'a>(
    key: &str,
    fields: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
) -> String {
    let mut hash = Sha256::new();
    hash.update(b"idemgate/fingerprint/business-key/v1\0");
    let part = |hash: &mut Sha256, bytes: &[u8]| {
        hash.update((bytes.len() as u64).to_be_bytes());
        hash.update(bytes);
    };
    part(&mut hash, key.as_bytes());
    for (name, value) in fields {
        part(&mut hash, name.as_bytes());
        match value {
            Some(value) => part(&mut hash, value.as_bytes()),
            // Absent differs from every value, the empty one included.
            None => hash.update(u64::MAX.to_be_bytes()),
        }
    }
    format!("k1:{}", hex::encode(hash.finalize()))
}

/// A response body as captured for storage.
pub enum Captured {
    /// The whole body, within the cap.
    Whole(Bytes),
    /// Over the cap: what was read, and the rest still to stream.
    TooLarge(Bytes, Body),
    /// The upstream connection broke mid-body.
    Broken(String),
}

/// Reads a response body up to `cap` bytes.
pub async fn capture(mut body: Body, cap: usize) -> Captured {
    let mut buffer = BytesMut::new();
    loop {
        match body.frame().await {
            None => return Captured::Whole(buffer.freeze()),
            Some(Err(e)) => return Captured::Broken(e.to_string()),
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue; // trailers are not stored
                };
                buffer.extend_from_slice(&data);
                if buffer.len() > cap {
                    return Captured::TooLarge(buffer.freeze(), body);
                }
            }
        }
    }
}

/// `prefix` followed by the rest of `body`, streamed.
pub fn chain(prefix: Bytes, body: Body) -> Body {
    let head = futures_util::stream::once(async move { Ok::<_, axum::Error>(prefix) });
    Body::from_stream(head.chain(body.into_data_stream()))
}
