//! A record row as the store's [`Record`], whichever database read it.

use std::time::Duration;

use bytes::Bytes;
use sqlx::Row;

use super::super::codec::decode_fields;
use super::super::{Claim, Record, RecordKey, RecordState, StoreError, StoredResponse};

/// What a claim answers when the record exists and could not be taken
/// over (the takeover statement decided that; this only explains it).
pub(super) fn answer_for(record: &Record, fingerprint: &str) -> Claim {
    let now = record.read_at_ms;
    let expires_at_ms = record.expires_at_ms;
    let lease_left = Duration::from_millis((record.lease_until_ms - now).max(0) as u64);
    if record.state == RecordState::Released {
        // Free for any request: a concurrent claim took it between the
        // takeover and this read. Claim again.
        return Claim::InFlight {
            retry_after: Duration::ZERO,
            expires_at_ms,
        };
    }
    if expires_at_ms <= now && !record.is_held() {
        // Past its retention and not taken over: a tombstone (or a row a
        // concurrent takeover is renewing; its next read tells).
        return if record.fingerprint != fingerprint {
            Claim::Mismatch { expires_at_ms }
        } else if record.forgotten_at_ms > now {
            Claim::Expired {
                forgotten_at_ms: record.forgotten_at_ms,
            }
        } else {
            Claim::InFlight {
                retry_after: Duration::ZERO,
                expires_at_ms,
            }
        };
    }
    if record.fingerprint != fingerprint {
        return Claim::Mismatch { expires_at_ms };
    }
    match (&record.state, &record.response) {
        (RecordState::Completed, Some(response)) => Claim::Completed {
            response: response.clone(),
            expires_at_ms,
        },
        (RecordState::Uncertain, _) if !lease_left.is_zero() => Claim::Uncertain {
            epoch: record.epoch,
            retry_after: lease_left,
            expires_at_ms,
        },
        _ => Claim::InFlight {
            retry_after: lease_left,
            expires_at_ms,
        },
    }
}

/// A row as read, before decoding.
pub(super) struct RawRecord {
    fingerprint: String,
    state: String,
    epoch: i64,
    lease_until: i64,
    request_id: String,
    status: Option<i32>,
    headers: Option<Vec<u8>>,
    body: Option<Vec<u8>>,
    body_kept: bool,
    created_at: i64,
    updated_at: i64,
    expires_at: i64,
    scope: String,
    route: String,
    key: String,
    read_at: i64,
}

impl RawRecord {
    pub(super) fn read<'r, R>(row: &'r R) -> Result<RawRecord, sqlx::Error>
    where
        R: Row,
        usize: sqlx::ColumnIndex<R>,
        String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        bool: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    {
        Ok(RawRecord {
            fingerprint: row.try_get(0)?,
            state: row.try_get(1)?,
            epoch: row.try_get(2)?,
            lease_until: row.try_get(3)?,
            request_id: row.try_get(4)?,
            status: row.try_get(5)?,
            headers: row.try_get(6)?,
            body: row.try_get(7)?,
            body_kept: row.try_get(8)?,
            created_at: row.try_get(9)?,
            updated_at: row.try_get(10)?,
            expires_at: row.try_get(11)?,
            scope: row.try_get(12)?,
            route: row.try_get(13)?,
            key: row.try_get(14)?,
            read_at: row.try_get(15)?,
        })
    }

    /// The record, with its tombstone's end (`tombstone` after its
    /// retention).
    pub(super) fn into_record(self, tombstone: Duration) -> Result<Record, StoreError> {
        let state = RecordState::parse(&self.state)?;
        // A tombstone's answer was dropped by the sweeper.
        let (headers, trailers) = match self.headers.as_deref() {
            Some(bytes) => decode_fields(bytes).map_err(StoreError::Corrupt)?,
            None => Default::default(),
        };
        let response = match (state, self.status) {
            (RecordState::Completed, Some(status)) => Some(StoredResponse {
                status: u16::try_from(status)
                    .map_err(|_| StoreError::Corrupt(format!("status {status}")))?,
                headers,
                trailers,
                body: Bytes::from(self.body.unwrap_or_default()),
                body_kept: self.body_kept,
                request_id: self.request_id.clone(),
            }),
            _ => None,
        };
        Ok(Record {
            key: RecordKey {
                scope: self.scope,
                route: self.route,
                key: self.key,
            },
            fingerprint: self.fingerprint,
            state,
            epoch: self.epoch,
            lease_until_ms: self.lease_until,
            request_id: self.request_id,
            response,
            created_at_ms: self.created_at,
            updated_at_ms: self.updated_at,
            expires_at_ms: self.expires_at,
            forgotten_at_ms: self
                .expires_at
                .saturating_add(i64::try_from(tombstone.as_millis()).unwrap_or(i64::MAX / 4)),
            read_at_ms: self.read_at,
        })
    }
}
