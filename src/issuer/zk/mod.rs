//! The ZooKeeper issuer (feature `zk`): a lock is an ephemeral sequential znode under the
//! resource's node; its fence token is the zxid that created it.
//!
//! The design is documented on [`ZkIssuer`].

mod held;
mod names;
mod recipe;
mod session;
mod url;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use zookeeper_client::Client;

use super::keys::{DEFAULT_KEY_PREFIX, check_key_prefix};
use super::methods::issuer_methods;
#[cfg(doc)]
use super::{Lease, LeaseState, LockStatus, ReleaseOutcome};
#[cfg(doc)]
use crate::Error;
use crate::{Resource, Result};
use held::{Held, Inner, remove_strays};
pub use names::lock_dir;
use names::prefixed_lock_dir;
pub(crate) use session::is_transient;
use session::{ended, open_session};
pub use url::SCHEME;
use url::parse_url;

/// Issues leases and fence tokens from a ZooKeeper ensemble (3.5 or newer; feature `zk`).
///
/// The same methods and [`Lease`] / [`ReleaseOutcome`] / [`LeaseState`] / [`LockStatus`] as
/// [`RedisIssuer`](crate::RedisIssuer) and the `EtcdIssuer`, and it implements
/// [`TokenIssuer`](crate::TokenIssuer) ([`IssuerKind::ZooKeeper`](crate::issuer::IssuerKind::ZooKeeper)),
/// where [`raise_floor`](crate::TokenIssuer::raise_floor) and
/// [`recover_from`](crate::TokenIssuer::recover_from) are no-ops: zxids never go backwards.
/// Cloning is cheap; clones share one ZooKeeper session.
///
/// ```no_run
/// # async fn f() -> pgfence::Result<()> {
/// use std::time::Duration;
/// let issuer = pgfence::issuer::ZkIssuer::connect("zk://10.0.0.1:2181,10.0.0.2:2181,10.0.0.3:2181").await?;
/// let resource = pgfence::Resource::new("payments:batch:42")?;
/// if let Some(lease) = issuer.acquire(&resource, Duration::from_secs(30)).await? {
///     println!("token {}", lease.token()); // the zxid that created the lock node
///     issuer.release(&lease).await?;
/// }
/// # Ok(()) }
/// ```
///
/// # Why zxids
///
/// Every change to a ZooKeeper ensemble gets a **zxid**, `epoch << 32 | counter`: the counter
/// counts the leader's proposals, the epoch counts leader elections. A zxid a client has seen
/// committed survives the loss of any minority of servers, the leader included, and a new
/// leader starts a higher epoch, so zxids never go backwards across failovers. The token is the
/// lock node's `czxid` (the zxid of its creation), **not** its sequence suffix: the suffix is a
/// signed 32-bit counter that wraps, and it is per parent node.
///
/// Tokens are at most [`MAX_TOKEN`](crate::token::MAX_TOKEN) = 2^39 − 1, so this issuer works while the
/// ensemble's epoch is below 128 (an ensemble starts at epoch 1, and each leader election adds
/// one). An acquire whose zxid would exceed it fails with [`InvalidInput::Token`](crate::error::InvalidInput::Token) and leaves no
/// lock behind. Like the etcd issuer, zxids are ensemble-wide, so tokens compare across
/// resources, and an ensemble rebuilt empty starts low again (Postgres then rejects its tokens,
/// safely, until they pass the old ones).
///
/// # Layout
///
/// Resource `R`'s lock lives under the persistent node `/pgfence/lock/R` ([`lock_dir`];
/// `/PREFIX/lock/R` with [`ZkIssuer::with_key_prefix`]; names `%`-encoded), created on first
/// use as a *container* node (ZooKeeper deletes it once it has had children and has none). An
/// acquire creates the ephemeral sequential child `lock-<owner>-<sequence>` holding the owner
/// id; the child with the lowest sequence holds the lock. A try that finds another child first
/// deletes its own and reports the lock as held, so there is no queue of waiters: waiting
/// ([`ZkIssuer::acquire_wait`]) retries with backoff, as the other issuers do. The owner id in
/// the name makes a retried acquire find the node an earlier, unanswered try created.
///
/// # TTLs and sessions
///
/// An ephemeral node lives as long as the ZooKeeper session that created it; ZooKeeper has no
/// per-node expiry for ephemeral nodes. The lease TTL is kept by this issuer: each lease has a
/// timer (a tokio task) that deletes its node when the TTL runs out without an
/// [`extend`](ZkIssuer::extend), so the lock ends when the TTL says, as with Redis. If the
/// process stops (crash, `SIGSTOP`, a pause longer than the session timeout), the timer cannot
/// run, and the **session timeout** ends the lock instead: the servers expire the session and
/// delete its nodes. So a lock outlives a dead holder by at most the session timeout (10 s by
/// default; `?session_timeout_ms=N` in the URL, bounded by the servers' min/max session
/// timeout), and a paused holder can lose its lock before its TTL — which is what fencing is
/// for. A lock node belongs to the session (this issuer and its clones) that created it: a
/// lease can be released from any issuer, but extended only by the one that acquired it
/// (others get [`InvalidInput::Owner`](crate::error::InvalidInput::Owner)). When the session expires, the next call opens a new
/// one; leases of the old session are gone ([`LeaseState::Expired`]).
///
/// # No TLS
///
/// This issuer speaks plain TCP only. ZooKeeper's TLS (its secure client port, Netty and
/// Java keystores on the servers) is not supported: the client's TLS would bring in a second
/// rustls crypto provider (aws-lc-rs, a C build) next to the `ring` one pgfence uses for
/// Redis, etcd and PostgreSQL. A URL that asks for TLS — `zks://`, `zk+tls://`, or a `tls`,
/// `ssl`, `secure`, `cacert`, `cert` or `key` parameter on `zk://` — fails with
/// [`Error::TlsUnsupported`] instead of silently connecting in the clear. To protect the
/// traffic, run a TLS tunnel (stunnel, ghostunnel, a service mesh sidecar) next to each
/// process and give its local end as `zk://127.0.0.1:PORT`; or use the etcd issuer
/// (`etcd+https://`), which speaks TLS itself.
#[derive(Clone)]
pub struct ZkIssuer {
    inner: Arc<Inner>,
    prefix: Arc<str>,
    call_timeout: Duration,
}

impl std::fmt::Debug for ZkIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkIssuer")
            .field("hosts", &self.inner.hosts)
            .field("session_timeout", &self.inner.session_timeout)
            .field("key_prefix", &self.prefix)
            .field("call_timeout", &self.call_timeout)
            .finish_non_exhaustive()
    }
}

impl ZkIssuer {
    /// Connects to the ensemble named by `url`: `zk://host[:port][,host[:port]...]` (port 2181
    /// by default), optionally `?session_timeout_ms=N` (default 10,000). Plain TCP, no auth.
    ///
    /// # Errors
    /// [`InvalidInput::IssuerUrl`](crate::error::InvalidInput::IssuerUrl) for a malformed URL; [`Error::Backend`] when no session
    /// could be opened within 10 s.
    pub async fn connect(url: &str) -> Result<Self> {
        let (hosts, session_timeout) = parse_url(url)?;
        let client = open_session(&hosts, session_timeout).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                hosts,
                session_timeout,
                client: Mutex::new(client),
                reconnecting: tokio::sync::Mutex::new(()),
                strays: tokio::sync::Mutex::new(HashSet::new()),
                held: Mutex::new(HashMap::new()),
            }),
            prefix: DEFAULT_KEY_PREFIX.into(),
            call_timeout: crate::issuer::DEFAULT_CALL_TIMEOUT,
        })
    }

    /// The same issuer (same session) with another key prefix: lock nodes live under
    /// `/PREFIX/lock/R`. Issuers with different prefixes share no lock (their tokens still come
    /// from the ensemble's one zxid sequence).
    ///
    /// # Errors
    /// [`InvalidInput::KeyPrefix`](crate::error::InvalidInput::KeyPrefix), as for [`RedisIssuer::with_key_prefix`](crate::RedisIssuer::with_key_prefix).
    pub fn with_key_prefix(mut self, prefix: &str) -> Result<Self> {
        self.prefix = check_key_prefix(prefix)?.into();
        Ok(self)
    }

    /// The key prefix (`pgfence` by default).
    #[must_use]
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// The same issuer with another call bound ([`DEFAULT_CALL_TIMEOUT`](crate::issuer::DEFAULT_CALL_TIMEOUT),
    /// 5 s, by default): an acquire, release, extend or status read returns within `bound`,
    /// its re-sends included, or fails with a [`Error::Backend`] timeout ([retryable](Error::is_retryable): the
    /// outcome is unknown). Each request also has the client's own 5 s timeout. The first
    /// attempt of a call gets at least 100 ms however small `bound` is. See
    /// `docs/issuers.md`, "Time bounds".
    #[must_use]
    pub fn with_call_timeout(mut self, bound: Duration) -> Self {
        self.call_timeout = bound;
        self
    }

    /// The call bound (see [`ZkIssuer::with_call_timeout`]).
    #[must_use]
    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// This issuer's znode for `resource`'s lock nodes: `/PREFIX/lock/R`.
    #[must_use]
    pub fn lock_dir(&self, resource: &Resource) -> String {
        prefixed_lock_dir(&self.prefix, resource)
    }

    /// The session timeout the servers granted (they bound the one asked for).
    #[must_use]
    pub fn session_timeout(&self) -> Duration {
        self.current().session_timeout()
    }

    /// The ZooKeeper session id (it changes when an expired session is replaced).
    #[must_use]
    pub fn session_id(&self) -> i64 {
        self.current().session_id().0
    }

    fn current(&self) -> Client {
        self.inner.current()
    }

    /// The session to use: the current one, or a new one when it has expired or closed (the
    /// leases of the old session are then over: their nodes are gone).
    async fn session(&self) -> Result<Client> {
        let client = self.current();
        if !ended(client.state()) {
            return Ok(client);
        }
        let _one = self.inner.reconnecting.lock().await;
        let client = self.current();
        if !ended(client.state()) {
            return Ok(client);
        }
        tracing::warn!(target: "pgfence::issuer", session = %client.session_id(), "ZooKeeper session ended; its locks are gone; opening a new session");
        let fresh = open_session(&self.inner.hosts, self.inner.session_timeout).await?;
        *self
            .inner
            .client
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = fresh.clone();
        let old: Vec<Arc<Held>> = self.held_map().drain().map(|(_, h)| h).collect();
        for held in old {
            held.end();
        }
        Ok(fresh)
    }

    fn held_map(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Arc<Held>>> {
        self.inner
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn held(&self, dir: &str, owner: &str) -> Option<Arc<Held>> {
        self.held_map()
            .get(&(dir.to_owned(), owner.to_owned()))
            .cloned()
    }

    /// Leaves the lock nodes `owner` may have left in `dir` to a cleanup task (see
    /// `Inner::strays`), unless an acquire of the same owner takes the lock over first.
    async fn sweep(&self, dir: &str, owner: &str) {
        let key = (dir.to_owned(), owner.to_owned());
        self.inner.strays.lock().await.insert(key.clone());
        tokio::spawn(remove_strays(Arc::downgrade(&self.inner), key));
    }
}

issuer_methods! {
    impl[] ZkIssuer {
        error: "[`Error::Backend`](crate::Error::Backend)",
        acquire: {}
        acquire_as: {
            /// ZooKeeper does not know the holder's remaining TTL, so `retry_in` is zero
            /// ("unknown").
        }
        acquire_wait: {}
        release: {
            ///
            /// Any issuer on the ensemble can release it (its node, same owner and token).
        }
        extend: {
            ///
            /// The node's existence is checked on the ensemble (one read); the deadline is this
            /// issuer's timer. Only the issuer that acquired a lease (its session) extends it:
            /// another gets [`InvalidInput::Owner`](crate::error::InvalidInput::Owner).
        }
        status: {
            /// `counter` is the zxid of the last change to the resource's lock nodes (every token
            /// issued for it so far is at most this; the next is above it). `ttl_ms` is known
            /// only for locks this issuer holds.
        }
    }
}
