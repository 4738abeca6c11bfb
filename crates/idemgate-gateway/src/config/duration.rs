//! [`HumanDuration`]: every duration of the file, read as text.
//!
//! A duration is judged in validation's second phase, not by serde (see
//! the module docs of [`crate::config`]): deserializing keeps the text the
//! operator wrote, so that every bad duration is reported at once, each
//! quoted as it was written. A default is built from a typed value and
//! spelled the way an operator would write it (`24h`, `1m`, `100ms`), so
//! that a message quoting it reads like the file.

use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// A duration written the human way (`500ms`, `30s`, `10m`, `24h`).
///
/// Deserializing never fails on a bad value: the raw text is kept so that
/// [`Config::validate`](super::Config::validate) can report every bad
/// duration at once.
#[derive(Debug, Clone)]
pub struct HumanDuration {
    raw: String,
    parsed: Option<Duration>,
}

impl HumanDuration {
    fn from_text(raw: &str) -> Self {
        let parsed = humantime::parse_duration(raw.trim()).ok();
        HumanDuration {
            raw: raw.to_owned(),
            parsed,
        }
    }

    /// The value; zero when invalid (validation has refused such a config).
    pub fn get(&self) -> Duration {
        self.parsed.unwrap_or_default()
    }

    /// The text as written (a default: its value in its largest whole
    /// unit), for messages to quote.
    pub(super) fn raw(&self) -> &str {
        &self.raw
    }

    /// The value when it is usable (parsed and above zero); `None` when
    /// [`HumanDuration::problem`] reports it, so checks that compare two
    /// durations skip a value that is already refused on its own.
    pub(super) fn valid(&self) -> Option<Duration> {
        self.parsed.filter(|d| !d.is_zero())
    }

    /// [`Self::problem`] for a key whose zero means "off".
    pub(super) fn problem_unless_zero(&self) -> Option<String> {
        match self.parsed {
            Some(d) if d.is_zero() => None,
            _ => self.problem(),
        }
    }

    /// Why the value cannot be used: not a duration, or zero.
    pub(super) fn problem(&self) -> Option<String> {
        match self.parsed {
            None => Some(format!(
                "{:?} is not a duration (write e.g. \"500ms\", \"30s\", \"10m\", \"24h\")",
                self.raw
            )),
            Some(d) if d.is_zero() => Some(format!("{:?} must be longer than zero", self.raw)),
            Some(_) => None,
        }
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(d)?;
        Ok(HumanDuration::from_text(&raw))
    }
}

impl From<&str> for HumanDuration {
    fn from(raw: &str) -> Self {
        HumanDuration::from_text(raw)
    }
}

/// A typed value (a default shared with the library crates), spelled in
/// its largest whole unit: `24h`, not humantime's `1day`, which is how
/// the file and the documentation write the defaults.
impl From<Duration> for HumanDuration {
    fn from(d: Duration) -> Self {
        HumanDuration {
            raw: spelled(d),
            parsed: Some(d),
        }
    }
}

/// `d` in the largest unit that holds it whole, in the units an operator
/// writes (hours at most: a day is written `24h`).
fn spelled(d: Duration) -> String {
    const UNITS: [(&str, u128); 5] = [
        ("h", 3_600_000_000_000),
        ("m", 60_000_000_000),
        ("s", 1_000_000_000),
        ("ms", 1_000_000),
        ("us", 1_000),
    ];
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".to_owned();
    }
    for (unit, size) in UNITS {
        if nanos.is_multiple_of(size) {
            return format!("{}{unit}", nanos / size);
        }
    }
    format!("{nanos}ns")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{problems_of, reasons_for};

    #[test]
    fn a_default_reads_as_an_operator_writes_it_and_parses_back() {
        for (value, text) in [
            (Duration::from_secs(24 * 3600), "24h"),
            (Duration::from_secs(600), "10m"),
            (Duration::from_secs(60), "1m"),
            (Duration::from_secs(30), "30s"),
            (Duration::from_millis(100), "100ms"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::ZERO, "0s"),
        ] {
            let d = HumanDuration::from(value);
            assert_eq!(d.raw(), text);
            assert_eq!(HumanDuration::from(text).get(), value, "{text}");
        }
    }

    /// Every duration key of the file, as validation names it.
    const DURATION_KEYS: &[&str] = &[
        "server.header_read_timeout",
        "server.body_read_timeout",
        "server.shutdown_grace",
        "store.retention",
        "store.lease",
        "store.timeout",
        "store.sweep_interval",
        "store.fast_layer_budget",
        "tokens.ttl",
        "upstreams[0].timeout",
        "routes[0].signature.tolerance",
    ];

    /// A config with every duration of [`DURATION_KEYS`] set to `value`.
    fn every_duration(value: &str) -> String {
        format!(
            r#"
            [server]
            header_read_timeout = "{value}"
            body_read_timeout = "{value}"
            shutdown_grace = "{value}"
            [store]
            retention = "{value}"
            lease = "{value}"
            timeout = "{value}"
            sweep_interval = "{value}"
            fast_layer_budget = "{value}"
            [tokens]
            ttl = "{value}"
            [[upstreams]]
            name = "o"
            url = "http://127.0.0.1:9001"
            timeout = "{value}"
            [[routes]]
            name = "hook"
            path = "/hook"
            upstream = "o"
            kind = "callback"
            business_key = ["json:/id"]
            [routes.signature]
            scheme = "stripe"
            secrets = ["whsec_x"]
            tolerance = "{value}"
            "#
        )
    }

    #[test]
    fn every_duration_key_refuses_text_that_is_not_a_duration() {
        let problems = problems_of(&every_duration("abc"));
        for key in DURATION_KEYS {
            let reasons = reasons_for(&problems, key);
            assert_eq!(reasons.len(), 1, "{key}: {problems:?}");
            assert!(reasons[0].contains("\"abc\""), "{key}: {}", reasons[0]);
            assert!(
                reasons[0].contains("not a duration"),
                "{key}: {}",
                reasons[0]
            );
        }
        assert_eq!(problems.len(), DURATION_KEYS.len(), "{problems:?}");
    }

    #[test]
    fn every_duration_key_refuses_zero() {
        let problems = problems_of(&every_duration("0s"));
        for key in DURATION_KEYS {
            let reasons = reasons_for(&problems, key);
            // One each: lease and budget are not also compared with a zero
            // store.timeout.
            assert_eq!(reasons.len(), 1, "{key}: {problems:?}");
            assert!(reasons[0].contains("\"0s\""), "{key}: {}", reasons[0]);
            assert!(
                reasons[0].contains("longer than zero"),
                "{key}: {}",
                reasons[0]
            );
        }
        assert_eq!(problems.len(), DURATION_KEYS.len(), "{problems:?}");
    }
}
