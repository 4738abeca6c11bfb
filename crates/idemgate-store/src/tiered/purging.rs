//! Purges, as operators make them: a record removed from SQL (never one
//! held under a live lease) and from every fast layer that may replay it,
//! this process's and, through the purge log, every other's.

use super::{Store, TOKEN_NAMESPACE};
use crate::{Record, RecordKey, StoreError};

impl Store {
    /// `Self::find` for operators, who name a record by the route it was
    /// used on: a token's record lives under the token namespace
    /// (`idemgate::token::TOKEN_RECORDS`), whatever route used it.
    pub async fn find_for_operator(
        &self,
        route: &str,
        key: &str,
    ) -> Result<Vec<Record>, StoreError> {
        let found = self.sql.find(route, key).await?;
        if !found.is_empty() {
            return Ok(found);
        }
        self.sql.find(TOKEN_NAMESPACE, key).await
    }

    /// `Self::purge` for operators (a key found under no route is looked
    /// for among the tokens, as [`Self::find_for_operator`] does), answered
    /// once the purge has settled:
    /// `crate::purges::SETTLE` after it was logged, every process's
    /// in-memory layer has applied it (or stopped replaying from memory),
    /// and the fast layer is then cleared of the key once more — a claim
    /// that read the completed record from SQL just before the purge may
    /// have written it back just after the first removal, before its
    /// process had read the purge log. What the admin API and the CLI run.
    pub async fn purge_settled(
        &self,
        route: &str,
        key: &str,
        scope: Option<&str>,
    ) -> Result<crate::sql::Purged, StoreError> {
        let (mut purged, mut keys) = self.purge_keys(route, key, scope).await?;
        if purged.removed == 0 && purged.held == 0 {
            (purged, keys) = self.purge_keys(TOKEN_NAMESPACE, key, scope).await?;
        }
        if purged.removed > 0 {
            // A task of its own: an operator who hangs up during the wait
            // must not cancel the second removal.
            let store = self.clone();
            let settled = tokio::spawn(async move {
                tokio::time::sleep(crate::purges::SETTLE).await;
                for k in &keys {
                    store.forget_for_purge(k).await?;
                }
                Ok::<_, StoreError>(())
            });
            settled.await.map_err(|e| StoreError::Unavailable {
                op: "purge",
                cause: e.to_string(),
            })??;
        } else if purged.held == 0
            && let Some(scope) = scope
        {
            // Nothing in SQL: a purge repeated after the fast layer could
            // not be cleared, which it now is for the client named. (A
            // held record's in-flight marker is left alone.)
            for route in [route, TOKEN_NAMESPACE] {
                self.forget_for_purge(&RecordKey::new(scope, route, key))
                    .await?;
            }
        }
        Ok(purged)
    }

    /// [`Self::forget`] for a purge, which must not be reported done while
    /// the fast layer may still replay the key: bounded by `store.timeout`
    /// (not the fast layer's budget), and an error when it failed.
    async fn forget_for_purge(&self, key: &RecordKey) -> Result<(), StoreError> {
        let Some(fast) = &self.fast else {
            return Ok(());
        };
        let bound = self.sql.timeout();
        let cause = match tokio::time::timeout(bound, fast.remove(key)).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {bound:?}"),
        };
        tracing::warn!(route = %key.route, key = %key.escaped(), layer = "fast", %cause, "purged in SQL, but the fast layer could not be cleared");
        Err(StoreError::Unavailable {
            op: "purge",
            cause: format!(
                "the record was purged in SQL but the fast layer could not be cleared \
                 ({cause}); it may still be replayed from there until the key is purged \
                 again, naming its client, once the fast layer answers"
            ),
        })
    }

    /// Removes records from SQL and the fast layer, except those held under
    /// a live lease (see [`crate::sql::Purged`]).
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg(any(test, feature = "testing"))]
    pub(crate) async fn purge(
        &self,
        route: &str,
        key: &str,
        scope: Option<&str>,
    ) -> Result<crate::sql::Purged, StoreError> {
        Ok(self.purge_keys(route, key, scope).await?.0)
    }

    /// [`Self::purge`], with the keys whose fast-layer entries it removed.
    async fn purge_keys(
        &self,
        route: &str,
        key: &str,
        scope: Option<&str>,
    ) -> Result<(crate::sql::Purged, Vec<RecordKey>), StoreError> {
        let keys: Vec<RecordKey> = match scope {
            Some(scope) => vec![RecordKey::new(scope, route, key)],
            None => self
                .sql
                .find(route, key)
                .await?
                .into_iter()
                .map(|r| r.key)
                .collect(),
        };
        let removed = self.sql.purge(route, key, scope).await?;
        for k in &keys {
            self.forget(k).await;
        }
        Ok((removed, keys))
    }
}
