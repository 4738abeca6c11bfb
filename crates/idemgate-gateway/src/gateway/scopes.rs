//! Records keep their identity (docs/semantics.md, rule 12): before a
//! configuration runs — at start-up and on every reload — what it says
//! scopes each record namespace is compared with what the store's registry
//! says the live records were written under (`idemgate_store::sql`'s
//! `Scoping`). A namespace the configuration would drop (a route removed,
//! renamed without keeping its `id`, no longer protected) or scope
//! otherwise (another identity source, other business-key sources) while
//! records under it are live or retained is refused, naming the route and
//! the count: those records would be out of reach, and their retries would
//! execute again — beside a copy still running, or after an answer the
//! client already had. Only a configuration that orphans nothing is
//! registered.

use std::collections::BTreeMap;
use std::time::{Duration, UNIX_EPOCH};

use idemgate_store::{Orphaned, Scoping};
use idemgate_store::{Store, StoreError};

use crate::config::{ConfigError, ConfigProblem, Plan, PolicyPlan};

/// The namespace every token's record sits under (whatever route it is
/// used on).
const TOKEN_RECORDS: &str = idemgate::token::TOKEN_RECORDS;

impl Plan {
    /// What this plan scopes each record namespace by: every protected
    /// route's and consumer's record identity, and `/token` for the tokens.
    pub fn scopings(&self) -> BTreeMap<String, Scoping> {
        let identity = self.identity.describe();
        let mut scopings = BTreeMap::new();
        let mut add = |records: &str, scope: String| {
            scopings.insert(
                records.to_owned(),
                Scoping {
                    records: records.to_owned(),
                    scope,
                },
            );
        };
        for route in &self.routes {
            match &route.policy {
                PolicyPlan::PassThrough => {}
                PolicyPlan::Key { .. } => {
                    add(route.record_id.as_str(), format!("key;identity={identity}"))
                }
                // A token is bound to its client's scope when issued.
                PolicyPlan::Token => add(TOKEN_RECORDS, format!("token;identity={identity}")),
                PolicyPlan::Callback(_) => add(
                    route.record_id.as_str(),
                    format!(
                        "callback;business_key={};by_path={}",
                        route.business_key.join(","),
                        route.scoped_by_path
                    ),
                ),
            }
        }
        for c in &self.consumers {
            add(
                c.record_id.as_str(),
                format!("consumer;business_key={}", c.business_key.join(",")),
            );
        }
        scopings
    }
}

/// What `plan` scopes its records by, to [`register`] once it runs; refused
/// (as a configuration error, every namespace named) when it would orphan
/// live records. The store unreachable is refused too: what cannot be
/// checked does not run.
pub(super) async fn check(
    store: &Store,
    plan: &Plan,
    origin: &str,
) -> Result<BTreeMap<String, Scoping>, ConfigError> {
    let scopings = plan.scopings();
    let orphaned = store
        .sql()
        .orphaned_by(&scopings)
        .await
        .map_err(|e| unchecked(origin, &e))?;
    if orphaned.is_empty() {
        return Ok(scopings);
    }
    Err(ConfigError::Invalid {
        origin: origin.to_owned(),
        problems: orphaned.iter().map(|o| problem(plan, o)).collect(),
    })
}

/// Registers what [`check`] passed as what the records are written under
/// from now on.
pub(super) async fn register(
    store: &Store,
    scopings: &BTreeMap<String, Scoping>,
) -> Result<(), StoreError> {
    store.sql().register_scopes(scopings).await
}

fn unchecked(origin: &str, e: &StoreError) -> ConfigError {
    ConfigError::Invalid {
        origin: origin.to_owned(),
        problems: vec![ConfigProblem {
            key: "store".into(),
            reason: format!(
                "the records' scopes could not be checked against this configuration ({e}); \
                 nothing that cannot be checked runs"
            ),
        }],
    }
}

/// One orphaned namespace, named by the entries of `plan` that keep it.
fn problem(plan: &Plan, o: &Orphaned) -> ConfigProblem {
    let until = humantime::format_rfc3339_seconds(
        UNIX_EPOCH + Duration::from_millis(u64::try_from(o.until_ms).unwrap_or(0)),
    );
    let count = format!(
        "{} live or retained record(s), the last kept until {until}",
        o.live
    );
    let keepers: Vec<String> = if o.route == TOKEN_RECORDS {
        plan.routes
            .iter()
            .enumerate()
            .filter(|(_, r)| matches!(r.policy, PolicyPlan::Token))
            .map(|(i, r)| format!("routes[{i}] ({:?})", r.name))
            .collect()
    } else {
        let routes = plan
            .routes
            .iter()
            .enumerate()
            .filter(|(_, r)| r.record_id == o.route)
            .map(|(i, r)| format!("routes[{i}] ({:?})", r.name));
        let consumers = plan
            .consumers
            .iter()
            .enumerate()
            .filter(|(_, c)| c.record_id == o.route)
            .map(|(i, c)| format!("consumers[{i}] ({:?})", c.name));
        routes.chain(consumers).collect()
    };
    match &o.now {
        Some(now) => ConfigProblem {
            key: keepers.first().cloned().unwrap_or_else(|| "routes".into()),
            reason: format!(
                "{} keep(s) the records under {:?}, written while they were scoped by {}; this \
                 configuration scopes them by {now}: {count}, would be out of reach and their \
                 retries executed again. Keep the old scope until then (or, for an identity \
                 source, see docs/semantics.md, \"Changing what scopes records\")",
                keepers.join(", "),
                o.route,
                o.was
            ),
        },
        None if o.route == TOKEN_RECORDS => ConfigProblem {
            key: "routes".into(),
            reason: format!(
                "tokens used within their records' retention ({count}) were bound to their \
                 clients' scopes ({}), and no token route of this configuration takes them: \
                 keep a token route until then",
                o.was
            ),
        },
        None => ConfigProblem {
            key: "routes".into(),
            reason: format!(
                "records kept under {:?} (scoped by {}): {count}, and no route or consumer of this \
                 configuration keeps them (removed, renamed without id = {:?}, or no longer \
                 protected): their retries would run again. Keep a route or consumer with id = \
                 {:?}, or keep it until then",
                o.route, o.was, o.route, o.route
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn scopings(text: &str) -> Vec<(String, String)> {
        let plan = Config::parse(text, "t").unwrap().validate("t").unwrap();
        plan.scopings()
            .into_iter()
            .map(|(k, v)| (k, v.scope))
            .collect()
    }

    const BASE: &str = r#"
        [identity]
        header = "X-User-Id"
        [[upstreams]]
        name = "o"
        url = "http://127.0.0.1:9001"
        [[routes]]
        name = "pay"
        path = "/pay"
        upstream = "o"
        idempotency = "key"
        [[routes]]
        name = "hook"
        path = "/hook"
        upstream = "o"
        kind = "callback"
        business_key = ["json:/id"]
        [[routes]]
        name = "checkout"
        path = "/checkout"
        upstream = "o"
        idempotency = "token"
        [[routes]]
        name = "read"
        path = "/read"
        upstream = "o"
        [[consumers]]
        name = "mq"
        source = "amqp://guest:guest@127.0.0.1:5672/%2f"
        queue = "q"
        upstream = "o"
        path = "/mq"
    "#;

    #[test]
    fn every_change_that_moves_records_changes_its_namespace_or_scope() {
        let base = scopings(BASE);
        let names: Vec<&str> = base.iter().map(|(k, _)| k.as_str()).collect();
        // Pass-through routes keep no records; tokens share one namespace.
        assert_eq!(names, ["/token", "hook", "mq", "pay"]);
        for changed in [
            BASE.replace("X-User-Id", "Authorization"),
            BASE.replace("json:/id", "json:/trade_no"),
            BASE.replace("path = \"/hook\"", "path_prefix = \"/hook/\""),
            BASE.replace(
                "path = \"/mq\"",
                "path = \"/mq\"\nbusiness_key = [\"json:/id\"]",
            ),
            BASE.replace("name = \"pay\"", "name = \"payments\""),
            BASE.replace("idempotency = \"key\"", ""),
        ] {
            assert_ne!(scopings(&changed), base, "{changed}");
        }
        // What moves no record: a rename that keeps the id, another
        // path, another upstream timeout, on_concurrent.
        for same in [
            BASE.replace("name = \"pay\"", "name = \"payments\"\nid = \"pay\""),
            BASE.replace("path = \"/pay\"", "path = \"/payments\""),
            BASE.replace(
                "idempotency = \"key\"",
                "idempotency = \"key\"\non_concurrent = \"wait\"",
            ),
            BASE.replace(
                "url = \"http://127.0.0.1:9001\"",
                "url = \"http://127.0.0.1:9002\"",
            ),
        ] {
            assert_eq!(scopings(&same), base, "{same}");
        }
    }
}
