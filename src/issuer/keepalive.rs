//! Background lease renewal. An efficiency aid that lets long jobs keep their lock, not a
//! correctness mechanism: a paused process stops renewing too, and fencing is what makes its
//! late writes harmless.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{Lease, LeaseState, TokenIssuer};

/// Why a kept-alive lease was lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseLost {
    /// The lock expired before a renewal reached the issuer.
    Expired,
    /// Another lease took the lock.
    Taken,
    /// The issuer (Redis, etcd) could not be reached before the lease's local deadline.
    Unreachable(String),
}

impl std::fmt::Display for LeaseLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeaseLost::Expired => f.write_str("the lock expired before it could be renewed"),
            LeaseLost::Taken => f.write_str("another holder took the lock"),
            LeaseLost::Unreachable(e) => {
                write!(f, "issuer unreachable until the lease ran out: {e}")
            }
        }
    }
}

/// Pause before renewing again after an error that was not about the lock.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

#[derive(Clone, Debug)]
enum State {
    Held(Instant),
    Lost(LeaseLost),
}

/// Renews a lease every TTL/3 until stopped or lost. Dropping it stops renewal (the lock then
/// expires on its own unless released).
///
/// A renewal that fails in transit (a connection closed by the server's idle `timeout`, a
/// reset, a refused reconnect, a stall) is re-sent on a fresh connection, with short
/// backoff, until the lease's local deadline. The lease is reported lost only when Redis
/// answers that it expired or was taken, or when the deadline passes with no renewal.
///
/// Works with any [`TokenIssuer`]: [`RedisIssuer::keep_alive`](crate::RedisIssuer::keep_alive),
/// [`KeepAlive::spawn`] with an `Arc<dyn TokenIssuer>` (an issuer chosen at run time by
/// [`connect_issuer`](crate::connect_issuer)), or with an `Arc` of a concrete issuer.
///
/// ```no_run
/// # async fn f(issuer: pgfence::RedisIssuer, lease: pgfence::Lease) {
/// let mut keep = issuer.keep_alive(&lease);
/// tokio::select! {
///     lost = keep.lost() => eprintln!("lease lost: {lost}; writes will be fenced"),
///     _ = tokio::time::sleep(std::time::Duration::from_secs(60)) => {}
/// }
/// keep.stop();
/// # }
/// ```
#[derive(Debug)]
pub struct KeepAlive {
    state: watch::Receiver<State>,
    task: JoinHandle<()>,
}

impl KeepAlive {
    /// Starts renewing `lease` through `issuer` every TTL/3, on the current Tokio runtime.
    ///
    /// ```no_run
    /// # async fn f() -> pgfence::Result<()> {
    /// let issuer = pgfence::connect_issuer("etcd://127.0.0.1:2379").await?;
    /// let resource = pgfence::Resource::new("reports:nightly")?;
    /// let ttl = std::time::Duration::from_secs(30);
    /// if let Some(lease) = issuer.acquire(&resource, ttl).await? {
    ///     let keep = pgfence::issuer::KeepAlive::spawn(issuer.clone(), lease.clone());
    ///     // ... work, fenced with lease.token() ...
    ///     keep.stop();
    ///     issuer.release(&lease).await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn spawn<I: TokenIssuer + ?Sized>(issuer: Arc<I>, mut lease: Lease) -> Self {
        let (tx, rx) = watch::channel(State::Held(lease.deadline()));
        let task = tokio::spawn(async move {
            let ttl = lease.ttl();
            let every = (ttl / 3).max(Duration::from_millis(5));
            let mut next = Instant::now() + every;
            loop {
                tokio::time::sleep_until(next).await;
                // Transport failures are retried inside, on fresh connections, until the
                // deadline: only the issuer's answer or the deadline ends a renewal.
                let deadline = lease.deadline();
                let lost = match issuer.extend_until(&mut lease, ttl, deadline).await {
                    Ok(LeaseState::Held) => {
                        let _ = tx.send(State::Held(lease.deadline()));
                        next = Instant::now() + every;
                        continue;
                    }
                    Ok(LeaseState::Expired) => LeaseLost::Expired,
                    Ok(LeaseState::Taken) => LeaseLost::Taken,
                    // Not an answer about the lock (say, a server error): try again while
                    // the lease may still be valid.
                    Err(e) if Instant::now() < deadline => {
                        tracing::debug!(target: "pgfence::keepalive", resource = lease.resource().as_str(), error = %e, "renewal failed; retrying");
                        next = Instant::now() + every.min(RETRY_PAUSE);
                        continue;
                    }
                    Err(e) => LeaseLost::Unreachable(e.to_string()),
                };
                tracing::warn!(target: "pgfence::keepalive", resource = lease.resource().as_str(), reason = %lost, "lease lost");
                crate::metrics::lease_lost();
                let _ = tx.send(State::Lost(lost));
                return;
            }
        });
        Self { state: rx, task }
    }

    /// Resolves when the lease is lost. Cancel-safe: use it in `select!`.
    pub async fn lost(&mut self) -> LeaseLost {
        loop {
            if let State::Lost(reason) = &*self.state.borrow_and_update() {
                return reason.clone();
            }
            if self.state.changed().await.is_err() {
                // The task ended without reporting (stopped): treat as never lost.
                std::future::pending::<()>().await;
            }
        }
    }

    /// The current local deadline of the lease, `None` once lost.
    #[must_use]
    pub fn deadline(&self) -> Option<Instant> {
        match &*self.state.borrow() {
            State::Held(d) => Some(*d),
            State::Lost(_) => None,
        }
    }

    /// Stops renewing.
    pub fn stop(self) {
        self.task.abort();
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.task.abort();
    }
}
