//! What scoped the records under each route identity (docs/semantics.md,
//! rule 12): the registry `idempotency_scopes`
//! (`migrations/*/…_scopes.sql`).
//!
//! A record is found by (client scope, route identity, key). Change what
//! makes any of the three — the identity source, a callback's business-key
//! sources, the route's identity itself (a rename without `id`, a route
//! removed) — and every live or retained record of that route is out of
//! reach: a retry of a request answered a second ago executes again, a
//! request still running gets a second copy beside it. So each
//! configuration says, per record namespace, what scopes it
//! ([`Scoping`]); before one runs (a start, a reload) it is compared with
//! what the registry says the records were written under, and every
//! namespace it would orphan while records under it are live is reported
//! with their count ([`Orphaned`]). Only a configuration with none is
//! registered.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use sqlx::Row;

use super::{DollarSql, Pool};
use crate::StoreError;
use crate::record::millis;
use crate::sql::{Orphaned, Scoping};

/// The statements, with the database's clock (`{now}`) filled in.
struct Statements {
    select: &'static str,
    upsert: String,
    delete: &'static str,
    live: String,
}

#[cfg(feature = "postgres")]
static POSTGRES: LazyLock<Statements> = LazyLock::new(|| statements(super::statements::PG_NOW));
#[cfg(feature = "sqlite")]
static SQLITE: LazyLock<Statements> = LazyLock::new(|| statements(super::statements::SQLITE_NOW));

fn statements(now: &str) -> Statements {
    Statements {
        select: "SELECT route, records, scope FROM idempotency_scopes",
        upsert: "INSERT INTO idempotency_scopes (route, records, scope, updated_at) \
             VALUES ($1, $2, $3, {now}) \
             ON CONFLICT (route) DO UPDATE SET records = $2, scope = $3, updated_at = {now}"
            .replace("{now}", now),
        delete: "DELETE FROM idempotency_scopes WHERE route = $1",
        // Live: within retention or tombstone (`$2` ms), or held. The
        // route leads the record table's primary key.
        live: "SELECT COUNT(*), COALESCE(MAX(CASE WHEN lease_until > expires_at + $2 \
               THEN lease_until ELSE expires_at + $2 END), 0) \
             FROM idempotency_records WHERE route = $1 AND (expires_at + $2 > {now} \
               OR (state IN ('in_flight', 'uncertain') AND lease_until > {now}))"
            .replace("{now}", now),
    }
}

impl DollarSql {
    fn scope_statements(&self) -> &'static Statements {
        match self.pool {
            #[cfg(feature = "postgres")]
            Pool::Postgres(_) => &POSTGRES,
            #[cfg(feature = "sqlite")]
            Pool::Sqlite(_) => &SQLITE,
        }
    }

    /// The registry: each namespace, where its records are, what scoped
    /// them.
    async fn registered(&self) -> Result<Vec<(String, String, String)>, sqlx::Error> {
        let s = self.scope_statements();
        with_pool!(self, pool => sqlx::query(s.select).fetch_all(pool).await?
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
            .collect())
    }

    /// Every namespace the registry knows that `planned` would drop or
    /// scope otherwise while records under it are live, with their count.
    /// Empty: `planned` may run.
    pub(crate) async fn orphaned_by(
        &self,
        planned: &BTreeMap<String, Scoping>,
    ) -> Result<Vec<Orphaned>, StoreError> {
        let s = self.scope_statements();
        let registered = self.bounded("scopes", self.registered()).await?;
        let tombstone = millis(self.tombstone);
        let mut orphaned = Vec::new();
        for (route, records, was) in registered {
            let now = planned.get(&route);
            if now.is_some_and(|n| n.records == records && n.scope == was) {
                continue;
            }
            let (live, until_ms): (i64, i64) = self
                .bounded("scopes", async {
                    with_pool!(self, pool => sqlx::query(s.live.as_str())
                        .bind(&records).bind(tombstone)
                        .fetch_one(pool).await
                        .and_then(|r| Ok((r.try_get(0)?, r.try_get(1)?))))
                })
                .await?;
            if live > 0 {
                orphaned.push(Orphaned {
                    route,
                    was,
                    now: now.map(|n| n.scope.clone()),
                    live: live as u64,
                    until_ms,
                });
            }
        }
        Ok(orphaned)
    }

    /// Records `planned` as what the records are written under from now on,
    /// and forgets the namespaces it drops (call it once
    /// [`Self::orphaned_by`] found nothing).
    pub(crate) async fn register_scopes(
        &self,
        planned: &BTreeMap<String, Scoping>,
    ) -> Result<(), StoreError> {
        let s = self.scope_statements();
        self.bounded("scopes", async {
            let registered = self.registered().await?;
            for (gone, ..) in registered.iter().filter(|(r, ..)| !planned.contains_key(r)) {
                with_pool!(self, pool => sqlx::query(s.delete).bind(gone).execute(pool).await.map(drop))?;
            }
            for (route, scoping) in planned {
                with_pool!(self, pool => sqlx::query(s.upsert.as_str())
                    .bind(route).bind(&scoping.records).bind(&scoping.scope)
                    .execute(pool).await.map(drop))?;
            }
            Ok(())
        })
        .await
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::RecordKey;

    fn plan(entries: &[(&str, &str)]) -> BTreeMap<String, Scoping> {
        entries
            .iter()
            .map(|(route, scope)| {
                (
                    route.to_string(),
                    Scoping {
                        records: route.to_string(),
                        scope: scope.to_string(),
                    },
                )
            })
            .collect()
    }

    #[tokio::test]
    async fn a_namespace_with_live_records_cannot_be_dropped_or_rescoped() {
        let sql = crate::sql::sqlite_in_memory().await;
        let first = plan(&[
            ("pay", "key;identity=header:x-user-id"),
            ("hook", "callback;business_key=json:/id;by_path=false"),
        ]);
        // Nothing registered yet: anything runs.
        assert!(sql.orphaned_by(&first).await.unwrap().is_empty());
        sql.register_scopes(&first).await.unwrap();
        // No records: a change orphans nothing.
        let changed = plan(&[("pay", "key;identity=header:authorization")]);
        assert!(sql.orphaned_by(&changed).await.unwrap().is_empty());
        // One live record of "pay".
        let key = RecordKey::new("c_1", "pay", "k-1");
        sql.claim(
            &key,
            "fp",
            "rid",
            Duration::from_secs(30),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        assert!(
            sql.orphaned_by(&first).await.unwrap().is_empty(),
            "the same plan"
        );
        let orphaned = sql.orphaned_by(&changed).await.unwrap();
        assert_eq!(orphaned.len(), 1, "{orphaned:?}");
        let o = &orphaned[0];
        assert_eq!((o.route.as_str(), o.live), ("pay", 1));
        assert_eq!(o.was, "key;identity=header:x-user-id");
        assert_eq!(o.now.as_deref(), Some("key;identity=header:authorization"));
        assert!(o.until_ms > crate::now_ms() + 50_000, "its retention's end");
        // Dropped altogether: orphaned too, with nothing to keep it.
        let dropped = sql.orphaned_by(&plan(&[])).await.unwrap();
        assert_eq!(dropped.len(), 1);
        assert_eq!(dropped[0].now, None);
        // "hook" has no records: dropping it is fine, and registering a
        // plan without it forgets it.
        let without_hook = plan(&[("pay", "key;identity=header:x-user-id")]);
        assert!(sql.orphaned_by(&without_hook).await.unwrap().is_empty());
        sql.register_scopes(&without_hook).await.unwrap();
        // Forgotten: a live record under "hook" now orphans nothing.
        let hooked = RecordKey::new("c_1", "hook", "k-2");
        sql.claim(
            &hooked,
            "fp",
            "rid",
            Duration::from_secs(30),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        let dropped = sql.orphaned_by(&plan(&[])).await.unwrap();
        let names: Vec<_> = dropped.iter().map(|o| o.route.as_str()).collect();
        assert_eq!(names, vec!["pay"]);
    }
}
