//! Business keys: `json:/pointer`, `header:Name`, `query:name`.
//!
//! Several sources form a composite key (MQ `msgId` + `topic`), joined with
//! length prefixes (`5:abcde|3:xyz`) so that `a:b` + `c` can never equal
//! `a` + `b:c`. A JSON value must be a non-empty scalar: strings are taken as
//! they are, numbers and booleans as their JSON text exactly as written
//! (`18446744073709551616` and `…617` are two keys, never one rounded
//! float); objects, arrays and null are refused (two different objects must
//! never map to one key). A key is at most [`MAX_KEY_BYTES`] bytes with no
//! control characters: the store's index refuses longer entries and
//! Postgres refuses NUL, and a refusal there would fail every other claim
//! batched with it.

use bytes::Bytes;
use http::request::Parts;

/// The longest business key, in bytes (the composite form included).
pub const MAX_KEY_BYTES: usize = 255;

/// Where one part of a business key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// An RFC 6901 pointer into the JSON body.
    Json(String),
    /// A request header.
    Header(http::HeaderName),
    /// A query-string parameter.
    Query(String),
}

/// Why no business key could be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BusinessKeyError {
    /// This source is absent or empty.
    #[error("{0} is missing or empty")]
    Missing(String),
    /// The source's value cannot be a key.
    #[error("{origin}: {reason}")]
    Invalid {
        /// The source (`json:/trade_no`, …).
        origin: String,
        /// Why (not JSON, an object, a control character, too long …).
        reason: String,
    },
}

impl KeySource {
    /// Parses one `business_key` entry, or says what is wrong with it.
    pub fn parse(text: &str) -> Result<KeySource, String> {
        let (kind, rest) = text
            .split_once(':')
            .ok_or_else(|| format!("{text:?} must be json:/pointer, header:Name or query:name"))?;
        match kind {
            "json" if rest.is_empty() || rest.starts_with('/') => Ok(KeySource::Json(rest.into())),
            "json" => Err(format!(
                "{text:?}: a JSON pointer starts with '/' (RFC 6901)"
            )),
            "header" => rest
                .parse::<http::HeaderName>()
                .map(KeySource::Header)
                .map_err(|_| format!("{text:?}: {rest:?} is not a header name")),
            "query" if !rest.is_empty() => Ok(KeySource::Query(rest.into())),
            _ => Err(format!(
                "{text:?} must be json:/pointer, header:Name or query:name"
            )),
        }
    }

    /// The source as written in the config.
    pub fn describe(&self) -> String {
        match self {
            KeySource::Json(p) => format!("json:{p}"),
            KeySource::Header(h) => format!("header:{h}"),
            KeySource::Query(q) => format!("query:{q}"),
        }
    }

    fn read(
        &self,
        parts: &Parts,
        json: &mut Option<Result<serde_json::Value, String>>,
        body: &Bytes,
    ) -> Result<String, BusinessKeyError> {
        let missing = || BusinessKeyError::Missing(self.describe());
        let invalid = |reason: &str| BusinessKeyError::Invalid {
            origin: self.describe(),
            reason: reason.to_owned(),
        };
        let value = match self {
            KeySource::Header(name) => {
                let mut values = parts.headers.get_all(name).iter();
                let value = values.next().ok_or_else(missing)?;
                if values.next().is_some() {
                    return Err(invalid("sent more than once"));
                }
                value
                    .to_str()
                    .map_err(|_| invalid("not visible ASCII"))?
                    .to_owned()
            }
            KeySource::Query(name) => {
                url::form_urlencoded::parse(parts.uri.query().unwrap_or_default().as_bytes())
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.into_owned())
                    .ok_or_else(missing)?
            }
            KeySource::Json(pointer) => {
                // Parse the body once, however many sources read it.
                let parsed = json.get_or_insert_with(|| {
                    serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))
                });
                let document = parsed.as_ref().map_err(|e| invalid(e))?;
                match document.pointer(pointer) {
                    None | Some(serde_json::Value::Null) => return Err(missing()),
                    Some(serde_json::Value::String(s)) => s.clone(),
                    Some(v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_))) => {
                        v.to_string()
                    }
                    Some(_) => return Err(invalid("an object or array is not a key")),
                }
            }
        };
        check_key_value(&self.describe(), value)
    }
}

/// One source's value as a key part: refused when empty (missing) or when
/// it holds a control character (Postgres refuses NUL, and the refusal
/// would fail every claim batched with it).
pub fn check_key_value(origin: &str, value: String) -> Result<String, BusinessKeyError> {
    if value.is_empty() {
        return Err(BusinessKeyError::Missing(origin.to_owned()));
    }
    if value.chars().any(char::is_control) {
        return Err(BusinessKeyError::Invalid {
            origin: origin.to_owned(),
            reason: "holds a control character".into(),
        });
    }
    Ok(value)
}

/// Joins the parts of a key: one part as it is, several with length
/// prefixes; refused over [`MAX_KEY_BYTES`].
pub fn join_key_values(values: Vec<String>) -> Result<String, BusinessKeyError> {
    let key = match <[String; 1]>::try_from(values) {
        Ok([single]) => single,
        Err(many) => many
            .iter()
            .map(|v| format!("{}:{v}", v.len()))
            .collect::<Vec<_>>()
            .join("|"),
    };
    if key.len() > MAX_KEY_BYTES {
        return Err(BusinessKeyError::Invalid {
            origin: "the business key".into(),
            reason: format!("{} bytes, over {MAX_KEY_BYTES}", key.len()),
        });
    }
    Ok(key)
}

/// The values of `must_match` sources as the fingerprint takes them: a
/// JSON value as its JSON text (any value; an object compares as written),
/// a header or query parameter as sent; `None` when absent. Never refuses:
/// an absent or unreadable field only differs from a present one.
pub fn match_values(sources: &[KeySource], parts: &Parts, body: &Bytes) -> Vec<Option<String>> {
    let json: Option<serde_json::Value> = sources
        .iter()
        .any(|s| matches!(s, KeySource::Json(_)))
        .then(|| serde_json::from_slice(body).ok())
        .flatten();
    sources
        .iter()
        .map(|source| match source {
            KeySource::Json(pointer) => json
                .as_ref()
                .and_then(|doc| doc.pointer(pointer))
                .map(|v| v.to_string()),
            KeySource::Header(name) => {
                let values: Vec<_> = parts
                    .headers
                    .get_all(name)
                    .iter()
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                    .collect();
                (!values.is_empty()).then(|| values.join(", "))
            }
            KeySource::Query(name) => {
                url::form_urlencoded::parse(parts.uri.query().unwrap_or_default().as_bytes())
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.into_owned())
            }
        })
        .collect()
}

/// Reads every source and joins them into one key.
pub fn business_key(
    sources: &[KeySource],
    parts: &Parts,
    body: &Bytes,
) -> Result<String, BusinessKeyError> {
    let mut json = None;
    let values = sources
        .iter()
        .map(|s| s.read(parts, &mut json, body))
        .collect::<Result<Vec<_>, _>>()?;
    join_key_values(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    fn sources(list: &[&str]) -> Vec<KeySource> {
        list.iter().map(|s| KeySource::parse(s).unwrap()).collect()
    }

    #[test]
    fn keys_come_from_json_headers_and_query() {
        let p = parts(
            "/cb?msg=42&x=1",
            &[("x-msg-id", "m-1"), ("x-topic", "orders")],
        );
        let body = Bytes::from_static(br#"{"trade_no":"T1","n":7,"ok":true,"nested":{"id":"a"}}"#);
        let key = |s: &[&str]| business_key(&sources(s), &p, &body);
        assert_eq!(key(&["json:/trade_no"]).unwrap(), "T1");
        assert_eq!(key(&["json:/n"]).unwrap(), "7");
        assert_eq!(key(&["json:/nested/id"]).unwrap(), "a");
        assert_eq!(key(&["query:msg"]).unwrap(), "42");
        assert_eq!(
            key(&["header:X-Msg-Id", "header:X-Topic"]).unwrap(),
            "3:m-1|6:orders"
        );
        assert!(matches!(
            key(&["json:/nested"]),
            Err(BusinessKeyError::Invalid { .. })
        ));
        assert!(matches!(
            key(&["json:/absent"]),
            Err(BusinessKeyError::Missing(_))
        ));
        assert!(matches!(
            key(&["header:x-absent"]),
            Err(BusinessKeyError::Missing(_))
        ));
        assert!(matches!(
            key(&["query:absent"]),
            Err(BusinessKeyError::Missing(_))
        ));
        let not_json = Bytes::from_static(b"trade_no=T1");
        assert!(matches!(
            business_key(&sources(&["json:/trade_no"]), &p, &not_json),
            Err(BusinessKeyError::Invalid { .. })
        ));
    }

    #[test]
    fn composite_keys_are_unambiguous() {
        let body = Bytes::new();
        let a = business_key(
            &sources(&["header:a", "header:b"]),
            &parts("/", &[("a", "x:y"), ("b", "z")]),
            &body,
        );
        let b = business_key(
            &sources(&["header:a", "header:b"]),
            &parts("/", &[("a", "x"), ("b", "y:z")]),
            &body,
        );
        assert_ne!(a.unwrap(), b.unwrap());
    }
}
