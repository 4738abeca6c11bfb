//! Whether a commit the store made survives a failover of its database.
//!
//! "Durable in SQL before forwarding" is only as true as the database's
//! commit: with asynchronous replication a promoted standby may lack the
//! last commits the old primary acknowledged, and a claim a client saw can
//! vanish. The database says which it is; this module asks it and names
//! the answer (`/readyz`, a metric, `check-config`, and
//! `store.require_synchronous`).

/// How a database acknowledges a commit, as far as a failover goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Durability {
    /// A standby has every commit before it is acknowledged (Postgres
    /// synchronous replication, a Galera cluster, lossless semi-synchronous
    /// replication): a failover to it loses none.
    Synchronous(String),
    /// Commits are acknowledged before any standby has them: a failover
    /// can lose the last ones.
    Asynchronous(String),
    /// No standby the store can see (SQLite; a lone server; a managed
    /// service that hides its replicas): nothing confirms that a promoted
    /// copy would hold a commit.
    Unconfirmed(String),
}

impl Durability {
    /// Whether a commit is known to survive a failover.
    pub fn survives_failover(&self) -> bool {
        matches!(self, Durability::Synchronous(_))
    }

    /// `synchronous`, `asynchronous` or `unconfirmed`.
    pub fn name(&self) -> &'static str {
        match self {
            Durability::Synchronous(_) => "synchronous",
            Durability::Asynchronous(_) => "asynchronous",
            Durability::Unconfirmed(_) => "unconfirmed",
        }
    }

    /// What the database said, in words.
    pub fn detail(&self) -> &str {
        match self {
            Durability::Synchronous(d)
            | Durability::Asynchronous(d)
            | Durability::Unconfirmed(d) => d,
        }
    }
}

impl std::fmt::Display for Durability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.name(), self.detail())
    }
}

#[cfg(feature = "postgres")]
/// Postgres: `synchronous_commit`, `synchronous_standby_names`, and the
/// standbys `pg_stat_replication` shows (synchronous ones, all).
pub(crate) fn postgres(commit: &str, standby_names: &str, sync: i64, all: i64) -> Durability {
    let waits_for_standby = matches!(commit, "on" | "remote_write" | "remote_apply");
    if waits_for_standby && !standby_names.trim().is_empty() {
        return Durability::Synchronous(if sync > 0 {
            format!(
                "synchronous_commit = {commit}, {sync} synchronous standby(s) of \
                 synchronous_standby_names = '{standby_names}'"
            )
        } else {
            format!(
                "synchronous_commit = {commit}, synchronous_standby_names = '{standby_names}', \
                 none connected: commits wait for one"
            )
        });
    }
    let why = if waits_for_standby {
        "synchronous_standby_names is empty".to_owned()
    } else {
        format!("synchronous_commit = {commit}")
    };
    if all > 0 {
        Durability::Asynchronous(format!("{all} standby(s), asynchronous: {why}"))
    } else {
        Durability::Unconfirmed(format!("no standby connected ({why})"))
    }
}

/// A semi-synchronous timeout at least this long (one day) is taken as
/// "never falls back to asynchronous".
#[cfg(feature = "mysql")]
const SEMI_SYNC_NO_FALLBACK_MS: u64 = 86_400_000;

#[cfg(feature = "mysql")]
/// MySQL and MariaDB, from their status and variables (names in lower
/// case): a Galera cluster, or semi-synchronous replication.
pub(crate) fn mysql(get: impl Fn(&str) -> Option<String>) -> Durability {
    let on = |name: &str| get(name).is_some_and(|v| v.eq_ignore_ascii_case("on"));
    if on("wsrep_on") {
        let status = get("wsrep_cluster_status").unwrap_or_default();
        let size: u64 = get("wsrep_cluster_size")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        return if status == "Primary" && on("wsrep_ready") && size >= 2 {
            Durability::Synchronous(format!(
                "Galera, {size} nodes in the primary component: a commit is certified on every \
                 node before it returns"
            ))
        } else if status == "Primary" && size == 1 {
            Durability::Unconfirmed("Galera with one node".into())
        } else {
            Durability::Unconfirmed(format!(
                "Galera node not in a primary component ({status:?})"
            ))
        };
    }
    // MySQL 8.0.26+ says "source", MariaDB and older MySQL "master".
    let semi_sync = on("rpl_semi_sync_source_status") || on("rpl_semi_sync_master_status");
    if semi_sync {
        let point = get("rpl_semi_sync_source_wait_point")
            .or_else(|| get("rpl_semi_sync_master_wait_point"))
            .unwrap_or_default()
            .to_ascii_uppercase();
        // Semi-sync falls back to asynchronous after its timeout (10 s
        // by default) without a replica's acknowledgement.
        let timeout_ms: u64 = get("rpl_semi_sync_source_timeout")
            .or_else(|| get("rpl_semi_sync_master_timeout"))
            .and_then(|t| t.parse().ok())
            .unwrap_or(0);
        return if point == "AFTER_SYNC" && timeout_ms >= SEMI_SYNC_NO_FALLBACK_MS {
            Durability::Synchronous(format!(
                "semi-synchronous replication, AFTER_SYNC, timeout {timeout_ms} ms: a replica \
                 has each commit before it returns"
            ))
        } else if point == "AFTER_SYNC" {
            Durability::Asynchronous(format!(
                "semi-synchronous replication falls back to asynchronous after its timeout \
                 ({timeout_ms} ms) without a replica"
            ))
        } else {
            Durability::Asynchronous(format!(
                "semi-synchronous replication with wait point {point}: a commit is visible before \
                 a replica has it"
            ))
        };
    }
    Durability::Unconfirmed(
        "no Galera and no semi-synchronous replication: any replica is asynchronous".into(),
    )
}

#[cfg(all(test, any(feature = "postgres", feature = "mysql")))]
mod tests {
    use super::*;

    #[cfg(feature = "postgres")]
    #[test]
    fn postgres_is_synchronous_only_with_named_standbys_and_a_waiting_commit() {
        assert!(postgres("on", "*", 1, 1).survives_failover());
        assert!(postgres("remote_apply", "FIRST 1 (s1)", 0, 0).survives_failover());
        assert_eq!(postgres("on", "", 0, 1).name(), "asynchronous");
        assert_eq!(postgres("local", "*", 1, 1).name(), "asynchronous");
        assert_eq!(postgres("off", "*", 1, 1).name(), "asynchronous");
        assert_eq!(postgres("on", "", 0, 0).name(), "unconfirmed");
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn mysql_is_synchronous_on_a_galera_quorum_or_lossless_semi_sync() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let galera: &'static [(&str, &str)] = &[
            ("wsrep_on", "ON"),
            ("wsrep_ready", "ON"),
            ("wsrep_cluster_status", "Primary"),
            ("wsrep_cluster_size", "3"),
        ];
        assert!(mysql(vars(galera)).survives_failover());
        let cut: &'static [(&str, &str)] = &[
            ("wsrep_on", "ON"),
            ("wsrep_ready", "OFF"),
            ("wsrep_cluster_status", "non-Primary"),
            ("wsrep_cluster_size", "1"),
        ];
        assert_eq!(mysql(vars(cut)).name(), "unconfirmed");
        let lossless: &'static [(&str, &str)] = &[
            ("rpl_semi_sync_master_status", "ON"),
            ("rpl_semi_sync_master_wait_point", "AFTER_SYNC"),
            ("rpl_semi_sync_master_timeout", "4294967295"),
        ];
        assert!(mysql(vars(lossless)).survives_failover());
        let falls_back: &'static [(&str, &str)] = &[
            ("rpl_semi_sync_master_status", "ON"),
            ("rpl_semi_sync_master_wait_point", "AFTER_SYNC"),
            ("rpl_semi_sync_master_timeout", "10000"),
        ];
        assert_eq!(mysql(vars(falls_back)).name(), "asynchronous");
        let after_commit: &'static [(&str, &str)] = &[
            ("rpl_semi_sync_source_status", "ON"),
            ("rpl_semi_sync_source_wait_point", "AFTER_COMMIT"),
        ];
        assert_eq!(mysql(vars(after_commit)).name(), "asynchronous");
        assert_eq!(mysql(vars(&[])).name(), "unconfirmed");
    }
}
