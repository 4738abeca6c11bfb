//! Byte encodings: stored headers (SQL column) and fast-layer entries.
//!
//! Both are length-prefixed binary, so any header value (even non-UTF-8)
//! survives byte for byte, and a truncated or foreign value fails to decode
//! instead of being misread.

use bytes::Bytes;

use super::{RecordKey, StoredResponse};

/// Version 2 carries the record's expiry. A version 1 value (an older
/// gateway beside this one) fails to decode and sends the request to SQL.
// Only the Redis layer stores entries; the in-process layer keeps values.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
const ENTRY_MAGIC: &[u8; 4] = b"IGF2";

/// What a fast-layer key holds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
pub enum FastEntry {
    /// A claim is running; duplicates are turned away.
    InFlight {
        /// Whose claim it marks.
        key: RecordKey,
        /// The claiming request's fingerprint: only the same request is
        /// told "in flight".
        fingerprint: String,
        /// The record's expiry as the marker's writer estimated it (its
        /// clock plus the retention): the marker is placed before the SQL
        /// claim that fixes the real one.
        expires_at_ms: i64,
    },
    /// The outcome, replayed without SQL.
    Completed {
        /// Whose outcome it is.
        key: RecordKey,
        /// The request's fingerprint: only the same request replays it.
        fingerprint: String,
        /// The outcome itself.
        response: StoredResponse,
        /// The record's expiry, by the database's clock.
        expires_at_ms: i64,
    },
}

impl FastEntry {
    /// The record this entry claims to describe.
    pub(crate) fn key(&self) -> &RecordKey {
        match self {
            FastEntry::InFlight { key, .. } | FastEntry::Completed { key, .. } => key,
        }
    }

    /// The fingerprint it was written for.
    pub(crate) fn fingerprint(&self) -> &str {
        match self {
            FastEntry::InFlight { fingerprint, .. } | FastEntry::Completed { fingerprint, .. } => {
                fingerprint
            }
        }
    }

    /// The record's expiry it carries.
    pub(crate) fn expires_at_ms(&self) -> i64 {
        match self {
            FastEntry::InFlight { expires_at_ms, .. }
            | FastEntry::Completed { expires_at_ms, .. } => *expires_at_ms,
        }
    }
}

/// The name prefix a trailer field is stored under, among the headers: no
/// HTTP field name can hold a `:`, so a gateway that does not know it
/// (an older one, reading the same store) skips such fields on replay
/// instead of misreading them, and the stored format stays one list.
const TRAILER_PREFIX: &str = "trailer:";

/// Encodes an answer's header and trailer fields as one list: a `u32`
/// count, then each as `u32 name length, name, u32 value length, value`
/// (trailers under [`TRAILER_PREFIX`]).
pub(crate) fn encode_fields(response: &StoredResponse) -> Vec<u8> {
    let mut out = Vec::with_capacity((response.headers.len() + response.trailers.len()) * 32);
    put_fields(&mut out, &response.headers, &response.trailers);
    out
}

/// Decodes [`encode_fields`]: the headers and the trailers.
pub(crate) fn decode_fields(bytes: &[u8]) -> Result<(Fields, Fields), String> {
    let mut r = Reader(bytes);
    let fields = r.fields()?;
    r.end()?;
    Ok(fields)
}

/// Header or trailer fields, in order: name, value.
pub(crate) type Fields = Vec<(String, Vec<u8>)>;

/// Encodes a fast-layer entry.
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub fn encode_entry(entry: &FastEntry) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(ENTRY_MAGIC);
    let (kind, key, fingerprint) = match entry {
        FastEntry::InFlight {
            key, fingerprint, ..
        } => (1u8, key, fingerprint),
        FastEntry::Completed {
            key, fingerprint, ..
        } => (2u8, key, fingerprint),
    };
    out.push(kind);
    for field in [&key.scope, &key.route, &key.key, fingerprint] {
        put(&mut out, field.as_bytes());
    }
    out.extend_from_slice(&entry.expires_at_ms().to_be_bytes());
    if let FastEntry::Completed { response, .. } = entry {
        out.extend_from_slice(&response.status.to_be_bytes());
        out.push(u8::from(response.body_kept));
        put(&mut out, response.request_id.as_bytes());
        put_fields(&mut out, &response.headers, &response.trailers);
        put(&mut out, &response.body);
    }
    out
}

/// Decodes [`encode_entry`]; anything else is an error.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn decode_entry(bytes: &[u8]) -> Result<FastEntry, String> {
    let rest = bytes
        .strip_prefix(ENTRY_MAGIC)
        .ok_or("not an idemgate entry")?;
    let (&kind, rest) = rest.split_first().ok_or("truncated")?;
    let mut r = Reader(rest);
    let key = RecordKey {
        scope: r.string()?,
        route: r.string()?,
        key: r.string()?,
    };
    let fingerprint = r.string()?;
    let expires_at_ms = i64::from_be_bytes(r.take(8)?.try_into().map_err(|_| "expiry")?);
    let entry = match kind {
        1 => FastEntry::InFlight {
            key,
            fingerprint,
            expires_at_ms,
        },
        2 => {
            let status = u16::from_be_bytes(r.take(2)?.try_into().map_err(|_| "status")?);
            let body_kept = r.take(1)?[0] == 1;
            let request_id = r.string()?;
            let (headers, trailers) = r.fields()?;
            let body = Bytes::copy_from_slice(r.field()?);
            FastEntry::Completed {
                key,
                fingerprint,
                response: StoredResponse {
                    status,
                    headers,
                    trailers,
                    body,
                    body_kept,
                    request_id,
                },
                expires_at_ms,
            }
        }
        _ => return Err(format!("unknown entry kind {kind}")),
    };
    r.end()?;
    Ok(entry)
}

fn put(out: &mut Vec<u8>, field: &[u8]) {
    out.extend_from_slice(&(field.len() as u32).to_be_bytes());
    out.extend_from_slice(field);
}

fn put_fields(out: &mut Vec<u8>, headers: &[(String, Vec<u8>)], trailers: &[(String, Vec<u8>)]) {
    out.extend_from_slice(&((headers.len() + trailers.len()) as u32).to_be_bytes());
    for (name, value) in headers {
        put(out, name.as_bytes());
        put(out, value);
    }
    for (name, value) in trailers {
        let prefixed = [TRAILER_PREFIX.as_bytes(), name.as_bytes()].concat();
        put(out, &prefixed);
        put(out, value);
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("truncated".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u32(&mut self) -> Result<usize, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }

    fn field(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()?;
        self.take(n)
    }

    fn string(&mut self) -> Result<String, String> {
        String::from_utf8(self.field()?.to_vec()).map_err(|_| "not UTF-8".into())
    }

    fn fields(&mut self) -> Result<(Fields, Fields), String> {
        let count = self.u32()?;
        let mut headers = Vec::with_capacity(count.min(256));
        let mut trailers = Vec::new();
        for _ in 0..count {
            let name = self.string()?;
            let value = self.field()?.to_vec();
            match name.strip_prefix(TRAILER_PREFIX) {
                Some(trailer) => trailers.push((trailer.to_owned(), value)),
                None => headers.push((name, value)),
            }
        }
        Ok((headers, trailers))
    }

    fn end(&self) -> Result<(), String> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err("trailing bytes".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_garbage_is_refused() {
        let key = RecordKey::new("s", "r", "k\u{1}");
        let entry = FastEntry::Completed {
            key: key.clone(),
            fingerprint: "fp".into(),
            response: StoredResponse {
                status: 201,
                headers: vec![("x-a".into(), vec![0xff, 0])],
                trailers: vec![("grpc-status".into(), b"0".to_vec())],
                body: Bytes::from_static(b"{}"),
                body_kept: true,
                request_id: "rid".into(),
            },
            expires_at_ms: 1_700_000_000_000,
        };
        let bytes = encode_entry(&entry);
        assert_eq!(decode_entry(&bytes).unwrap(), entry);
        assert!(decode_entry(&bytes[..bytes.len() - 1]).is_err());
        assert!(decode_entry(b"{\"json\":1}").is_err());
        let marker = FastEntry::InFlight {
            key,
            fingerprint: "fp".into(),
            expires_at_ms: -1,
        };
        assert_eq!(decode_entry(&encode_entry(&marker)).unwrap(), marker);
    }
}
