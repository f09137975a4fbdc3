//! The one bridge between the token issuer and Postgres: Postgres's high-water marks as the
//! floor a lost Redis counter restarts above, `reseed`, and recovery from a rejected write.
//!
//! Safety never depends on this module: Postgres rejects old tokens whatever Redis does. It
//! restores liveness after a Redis failover or restart lost the counter, which would otherwise
//! hand out tokens Postgres has already seen (every write rejected until reseeded).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use redis::aio::ConnectionLike;
use sqlx::PgPool;

use crate::issuer::fencing_name;
use crate::issuer::redis::FloorSource;
use crate::{Error, RedisIssuer, Resource, Result, admin::counter_floor};

/// A database's high-water marks as an issuer's [`FloorSource`].
#[derive(Clone, Debug)]
struct PgFloor(PgPool);

impl FloorSource for PgFloor {
    fn high_water<'a>(
        &'a self,
        resource: &'a Resource,
    ) -> Pin<Box<dyn Future<Output = Result<i64>> + Send + 'a>> {
        Box::pin(counter_floor(&self.0, resource))
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> RedisIssuer<C> {
    /// Makes counter loss recover by itself: when an acquire finds the counter missing (a new
    /// resource, or a Redis that restarted or failed over without its data), the issuer reads
    /// the resource's high-water mark from this database and, if it is not below the new
    /// token, raises the counter past it and re-issues the token before returning the lease.
    /// Costs one Postgres query per fresh counter, none on the common path.
    ///
    /// The high-water mark is the one [`crate::Fence::check`] maintains. Jobs that only write
    /// rows through a [`crate::Repository`] leave it at 0; for them, recover with
    /// [`RedisIssuer::recover_from`] on the first rejected write (or `pgfence reseed --floor`).
    #[must_use]
    pub fn with_floor_source(mut self, pool: PgPool) -> Self {
        self.floor_source = Some(Arc::new(PgFloor(pool)));
        self
    }

    /// Reseeds after a failover: raises `resource`'s counter to the high-water mark Postgres
    /// recorded for it ([`crate::Fence::check`]; for a resource in a fencing domain, the
    /// highest mark of the domain), so the next lease is accepted. Returns the counter
    /// afterwards. The marks read are those of this issuer's key prefix
    /// ([`Resource::in_key_prefix`]).
    ///
    /// # Errors
    /// [`Error::Backend`]; [`Error::Backend`]; [`InvalidInput::Resource`](crate::error::InvalidInput::Resource) for a name too long
    /// under the key prefix.
    pub async fn reseed(&self, pool: &PgPool, resource: &Resource) -> Result<i64> {
        let mark = counter_floor(pool, &fencing_name(self.key_prefix(), resource)?).await?;
        self.raise_floor(resource, mark).await
    }

    /// One-call recovery from a rejected write: if `err` is a [`Error::StaleToken`] or an
    /// [`Error::DuplicateToken`] and says which resource's lease was rejected (a check, or a
    /// row write whose [`Fencing`](crate::Fencing) came from a lease), raises that resource's
    /// counter to the token the write met, so the next lease's token is newer than everything
    /// Postgres has seen on that path. Returns whether the counter was raised. Use it when a
    /// freshly acquired lease is rejected (the counter went backwards). An error about a name
    /// of another key prefix ([`Resource::in_key_prefix`]) is not this issuer's: `Ok(false)`.
    ///
    /// # Errors
    /// [`Error::Backend`]; [`InvalidInput::Resource`](crate::error::InvalidInput::Resource) if the error names an invalid resource.
    pub async fn recover_from(&self, err: &Error) -> Result<bool> {
        let (target, floor) = match err {
            Error::StaleToken {
                target, current, ..
            } => (target, *current),
            Error::DuplicateToken { target, token } => (target, *token),
            _ => return Ok(false),
        };
        let Some(resource) = target.resource() else {
            return Ok(false);
        };
        let named = Resource::parse_fenced(resource)?;
        match named.key_prefix() {
            // A resource name: a lease of the default prefix, or a Fencing built by hand.
            None => {}
            Some(prefix) if prefix == self.key_prefix() => {}
            Some(_) => return Ok(false),
        }
        let resource = named.without_key_prefix();
        let before = self.status(&resource).await?.counter;
        Ok(self.raise_floor(&resource, floor).await? > before)
    }
}
