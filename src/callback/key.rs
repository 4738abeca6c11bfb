//! Business-key sources: `json:/pointer`, `header:Name`, `query:name`.

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
}
