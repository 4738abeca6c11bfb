//! `tokens.issue_per_minute`: how many tokens one principal is issued.
//!
//! Issuing writes nothing, but a client that fetches tokens in a loop (a
//! broken form, a bot) should be told to slow down before it matters. A
//! per-principal GCRA (the generic cell rate algorithm, as in `governor`):
//! one token every `60 s / n`, bursts of up to `n`; past it `429` with
//! `Retry-After`. The principal is the client scope, or for anonymous
//! clients their IP address. Per process: several instances each allow
//! `n`.
//!
//! Written here rather than with `governor`: the map of principals must be
//! bounded (docs/semantics.md, rule 10), and a keyed `governor` limiter grows until
//! pruned by hand; this is the same algorithm in a few lines, with the
//! bound built in: [`MAX_PRINCIPALS`] principals inside their window at
//! once, past which issuing is refused for new ones.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Principals tracked at once at most; when full, those whose window has
/// passed are dropped, and if none has, a new principal is refused.
pub const MAX_PRINCIPALS: usize = 100_000;

/// A per-principal issue rate.
pub struct IssueLimit {
    /// Time between two tokens at the sustained rate.
    emission: Duration,
    /// How far ahead of now a principal's schedule may run (its burst).
    tolerance: Duration,
    /// Each principal's theoretical arrival time.
    schedule: Mutex<HashMap<String, Instant>>,
}

impl IssueLimit {
    /// `per_minute` tokens per principal per minute; `None` for 0 (off).
    pub fn per_minute(per_minute: u32) -> Option<IssueLimit> {
        (per_minute > 0).then(|| {
            let emission = Duration::from_secs(60) / per_minute;
            IssueLimit {
                emission,
                tolerance: Duration::from_secs(60) - emission,
                schedule: Mutex::default(),
            }
        })
    }

    /// Takes one token for `principal`, or says how long until one is due.
    pub fn take(&self, principal: &str) -> Result<(), Duration> {
        let now = Instant::now();
        let mut schedule = self.schedule.lock().unwrap_or_else(|p| p.into_inner());
        if !schedule.contains_key(principal) && schedule.len() >= MAX_PRINCIPALS {
            schedule.retain(|_, tat| *tat > now);
            if schedule.len() >= MAX_PRINCIPALS {
                return Err(self.emission);
            }
        }
        let tat = schedule.get(principal).copied().unwrap_or(now).max(now);
        if tat > now + self.tolerance {
            return Err(tat - now - self.tolerance);
        }
        schedule.insert(principal.to_owned(), tat + self.emission);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_principal_gets_its_burst_then_the_sustained_rate() {
        let limit = IssueLimit::per_minute(6).unwrap();
        for _ in 0..6 {
            assert_eq!(limit.take("alice"), Ok(()));
        }
        let wait = limit.take("alice").unwrap_err();
        assert_eq!(wait, Duration::from_secs(10));
        // Another principal has its own allowance.
        assert_eq!(limit.take("bob"), Ok(()));
        tokio::time::advance(wait).await;
        assert_eq!(limit.take("alice"), Ok(()));
        assert!(limit.take("alice").is_err());
        assert!(IssueLimit::per_minute(0).is_none());
    }
}
