//! A message's business key: `msg:message_id`, `msg:topic`,
//! `msg:header:Name`, `json:/pointer` (docs/semantics.md, "Queues").
//!
//! The rules are the callback routes' (see [`idemgate::callback::KeySource`]):
//! several sources are joined with length prefixes, JSON values must be
//! non-empty scalars kept as written, and a key is at most
//! [`MAX_KEY_BYTES`] bytes without control characters. A message whose key
//! breaks a rule is dead-lettered and never forwarded.

use bytes::Bytes;

use crate::Message;
use idemgate::callback::{BusinessKeyError, MAX_KEY_BYTES, check_key_value, join_key_values};

/// Where one part of a message's key comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageKeySource {
    /// The broker's message id: AMQP's `message_id` property, NATS's
    /// `Nats-Msg-Id` header.
    MessageId,
    /// The routing key (AMQP) or the subject (NATS).
    Topic,
    /// A message header (AMQP headers table, NATS headers), by name;
    /// compared without regard to case.
    Header(String),
    /// An RFC 6901 pointer into the JSON body.
    Json(String),
}

/// The default key: the message id and the topic.
pub const DEFAULT_MESSAGE_KEY: [&str; 2] = ["msg:message_id", "msg:topic"];

impl MessageKeySource {
    /// Parses one `business_key` entry of a consumer.
    pub fn parse(text: &str) -> Result<MessageKeySource, String> {
        let wrong = || {
            format!("{text:?} must be msg:message_id, msg:topic, msg:header:Name or json:/pointer")
        };
        match text.split_once(':').ok_or_else(wrong)? {
            ("msg", "message_id") => Ok(MessageKeySource::MessageId),
            ("msg", "topic") => Ok(MessageKeySource::Topic),
            ("msg", rest) => match rest.split_once(':') {
                Some(("header", name)) if !name.is_empty() && !name.contains(char::is_control) => {
                    Ok(MessageKeySource::Header(name.to_owned()))
                }
                _ => Err(wrong()),
            },
            ("json", pointer) if pointer.is_empty() || pointer.starts_with('/') => {
                Ok(MessageKeySource::Json(pointer.to_owned()))
            }
            ("json", _) => Err(format!(
                "{text:?}: a JSON pointer starts with '/' (RFC 6901)"
            )),
            _ => Err(wrong()),
        }
    }

    /// The source as written in the config.
    pub fn describe(&self) -> String {
        match self {
            MessageKeySource::MessageId => "msg:message_id".into(),
            MessageKeySource::Topic => "msg:topic".into(),
            MessageKeySource::Header(name) => format!("msg:header:{name}"),
            MessageKeySource::Json(pointer) => format!("json:{pointer}"),
        }
    }
}

/// What a key is read from: the broker-neutral view of one message.
pub trait KeyedMessage {
    /// The broker's message id, if the message has one.
    fn message_id(&self) -> Option<&str>;
    /// The routing key or subject.
    fn topic(&self) -> &str;
    /// A header's value as text; `Err` when it is there but not text.
    fn header(&self, name: &str) -> Option<Result<String, String>>;
    /// The payload.
    fn body(&self) -> &Bytes;
}

/// The values of `must_match` sources (see
/// [`idemgate::callback::match_values`]): `None` when absent, never refused.
pub fn message_match_values(
    sources: &[MessageKeySource],
    message: &impl KeyedMessage,
) -> Vec<Option<String>> {
    let json: Option<serde_json::Value> = sources
        .iter()
        .any(|s| matches!(s, MessageKeySource::Json(_)))
        .then(|| serde_json::from_slice(message.body()).ok())
        .flatten();
    sources
        .iter()
        .map(|source| match source {
            MessageKeySource::MessageId => message.message_id().map(str::to_owned),
            MessageKeySource::Topic => Some(message.topic().to_owned()),
            MessageKeySource::Header(name) => message.header(name).map(|v| v.unwrap_or_else(|e| e)),
            MessageKeySource::Json(pointer) => json
                .as_ref()
                .and_then(|doc| doc.pointer(pointer))
                .map(|v| v.to_string()),
        })
        .collect()
}

/// Reads every source and joins them into one key.
pub fn message_key(
    sources: &[MessageKeySource],
    message: &impl KeyedMessage,
) -> Result<String, BusinessKeyError> {
    let mut json: Option<Result<serde_json::Value, String>> = None;
    let mut values = Vec::with_capacity(sources.len());
    for source in sources {
        let origin = source.describe();
        let invalid = |reason: String| BusinessKeyError::Invalid {
            origin: origin.clone(),
            reason,
        };
        let value = match source {
            MessageKeySource::MessageId => message.message_id().map(str::to_owned),
            MessageKeySource::Topic => Some(message.topic().to_owned()),
            MessageKeySource::Header(name) => message.header(name).transpose().map_err(invalid)?,
            MessageKeySource::Json(pointer) => {
                let parsed = json.get_or_insert_with(|| {
                    serde_json::from_slice(message.body())
                        .map_err(|e| format!("the body is not JSON: {e}"))
                });
                let document = parsed.as_ref().map_err(|e| invalid(e.clone()))?;
                match document.pointer(pointer) {
                    None | Some(serde_json::Value::Null) => None,
                    Some(serde_json::Value::String(s)) => Some(s.clone()),
                    Some(v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_))) => {
                        Some(v.to_string())
                    }
                    Some(_) => return Err(invalid("an object or array is not a key".into())),
                }
            }
        };
        let value = value.ok_or_else(|| BusinessKeyError::Missing(origin.clone()))?;
        // A fanout exchange routes with an empty key: beside the id, an
        // empty topic is a topic ("0:" in the composite), not a missing key.
        if matches!(source, MessageKeySource::Topic) && value.is_empty() && sources.len() > 1 {
            values.push(value);
            continue;
        }
        values.push(check_key_value(&origin, value)?);
    }
    let key = join_key_values(values)?;
    debug_assert!(key.len() <= MAX_KEY_BYTES);
    Ok(key)
}

// === a message's rows in the delivery log ===

/// Where the dead-letter mark of a message without a usable key is kept:
/// its broker id (as it came, unusable as a key) and body hashed, behind a
/// control character no usable key may hold, so it never meets a business
/// key. `None` without an id: a body alone does not name one message (two
/// keyless messages may carry the same), and a mark shared by two would
/// settle the second without its copy.
pub(crate) fn keyless_mark(message: &Message) -> Option<String> {
    use sha2::{Digest, Sha256};
    let id = message.id.as_deref()?.as_bytes();
    let copy = copy_id(message).unwrap_or_default();
    let mut hash = Sha256::new();
    for part in [id, copy.as_bytes()] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    hash.update(&message.body);
    Some(format!("\u{1}keyless:{}", hex::encode(hash.finalize())))
}

/// The store row that counts `message`'s failed attempts and keeps its
/// dead-letter mark: its key's, or for one of Idemgate's dead-letter
/// copies moved back to the source, a row of that copy's own.
pub(crate) fn delivery_row(key: &str, message: &Message) -> String {
    match copy_id(message) {
        Some(copy) => format!("{key}\u{1}copy:{copy}"),
        None => key.to_owned(),
    }
}

/// Which dead-letter copy `message` is, if it is one: the copy header each
/// broker's copy gets (`x-idemgate-copy`, `Idemgate-Copy`, `idemgate-copy`;
/// names compare without case), or for a copy made before that header, its
/// reason header.
pub(crate) fn copy_id(message: &Message) -> Option<String> {
    [
        "x-idemgate-copy",
        "idemgate-copy",
        "x-idemgate-reason",
        "idemgate-reason",
    ]
    .iter()
    .find_map(|name| message.header(name).and_then(Result::ok))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Msg {
        id: Option<&'static str>,
        topic: &'static str,
        headers: Vec<(&'static str, Result<&'static str, &'static str>)>,
        body: Bytes,
    }

    impl KeyedMessage for Msg {
        fn message_id(&self) -> Option<&str> {
            self.id
        }
        fn topic(&self) -> &str {
            self.topic
        }
        fn header(&self, name: &str) -> Option<Result<String, String>> {
            self.headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.map(str::to_owned).map_err(str::to_owned))
        }
        fn body(&self) -> &Bytes {
            &self.body
        }
    }

    fn msg(id: Option<&'static str>, body: &'static str) -> Msg {
        Msg {
            id,
            topic: "coupon.deduct",
            headers: vec![("X-Order", Ok("o-1")), ("x-bin", Err("a byte array"))],
            body: Bytes::from_static(body.as_bytes()),
        }
    }

    fn key(sources: &[&str], m: &Msg) -> Result<String, BusinessKeyError> {
        let sources: Vec<_> = sources
            .iter()
            .map(|s| MessageKeySource::parse(s).unwrap())
            .collect();
        message_key(&sources, m)
    }

    #[test]
    fn sources_parse_and_refuse() {
        assert_eq!(
            MessageKeySource::parse("msg:message_id"),
            Ok(MessageKeySource::MessageId)
        );
        assert_eq!(
            MessageKeySource::parse("msg:header:X-Order"),
            Ok(MessageKeySource::Header("X-Order".into()))
        );
        for bad in [
            "msg:id",
            "msg:header:",
            "header:X",
            "json:trade_no",
            "query:a",
            "x",
        ] {
            assert!(MessageKeySource::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn keys_come_from_the_id_topic_headers_and_body() {
        let m = msg(Some("m-1"), r#"{"coupon":"C9","n":7,"obj":{}}"#);
        assert_eq!(
            key(&DEFAULT_MESSAGE_KEY, &m).unwrap(),
            "3:m-1|13:coupon.deduct"
        );
        assert_eq!(key(&["msg:header:x-order"], &m).unwrap(), "o-1");
        assert_eq!(key(&["json:/coupon", "json:/n"], &m).unwrap(), "2:C9|1:7");
        assert!(matches!(
            key(&["json:/obj"], &m),
            Err(BusinessKeyError::Invalid { .. })
        ));
        assert!(matches!(
            key(&["msg:header:x-bin"], &m),
            Err(BusinessKeyError::Invalid { .. })
        ));
        assert!(matches!(
            key(&["msg:header:absent"], &m),
            Err(BusinessKeyError::Missing(_))
        ));
    }

    #[test]
    fn an_empty_topic_is_a_part_beside_the_id_but_not_a_key_alone() {
        let mut fanout = msg(Some("m-1"), "{}");
        fanout.topic = "";
        assert_eq!(key(&DEFAULT_MESSAGE_KEY, &fanout).unwrap(), "3:m-1|0:");
        assert!(matches!(
            key(&["msg:topic"], &fanout),
            Err(BusinessKeyError::Missing(_))
        ));
    }

    #[test]
    fn unusable_keys_are_refused() {
        let no_id = msg(None, "{}");
        assert!(matches!(
            key(&DEFAULT_MESSAGE_KEY, &no_id),
            Err(BusinessKeyError::Missing(_))
        ));
        let empty = msg(Some(""), "{}");
        assert!(matches!(
            key(&["msg:message_id"], &empty),
            Err(BusinessKeyError::Missing(_))
        ));
        let nul = msg(Some("a\0b"), "{}");
        assert!(matches!(
            key(&["msg:message_id"], &nul),
            Err(BusinessKeyError::Invalid { .. })
        ));
        let long: &'static str = "x".repeat(300).leak();
        assert!(matches!(
            key(&["msg:message_id"], &msg(Some(long), "{}")),
            Err(BusinessKeyError::Invalid { .. })
        ));
        assert!(matches!(
            key(&["json:/a"], &msg(Some("m"), "not json")),
            Err(BusinessKeyError::Invalid { .. })
        ));
    }
}
