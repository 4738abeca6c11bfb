//! What the test suite and the load generators reach that the gateway and
//! the library do not (feature `testing`): the layers of the store one by
//! one, so a test can fault or inspect a layer the composed [`Store`] hides.
//! Nothing here is a supported API; it moves with the tests.
//!
//! [`Store`]: crate::Store

pub use crate::codec::{FastEntry, encode_entry};
pub use crate::fast::{FastLayer, storage_key};
#[cfg(feature = "redis")]
pub use crate::near::NearLayer;
pub use crate::purges::SETTLE as PURGE_SETTLE;
#[cfg(feature = "redis")]
pub use crate::redis::RedisLayer;
pub use crate::sql::{MAX_LIVE_PARTITIONS, partition_span};
