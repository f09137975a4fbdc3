//! The ZooKeeper issuer (feature `zk`): a lock is an ephemeral sequential znode under the
//! resource's node; its fence token is the zxid that created it.
//!
//! The design is documented on [`ZkIssuer`].

mod held;
mod names;
mod session;
mod url;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use zookeeper_client::Client;

use super::keys::{DEFAULT_KEY_PREFIX, check_key_prefix};
use super::policy::{self, Ask, Attempt, Backend, PATIENT, Renewal, Resend, resend};
use super::token_issuer::IssuerKind;
use super::{Lease, LeaseState, LockStatus, ReleaseOutcome};
use crate::{Error, FenceToken, MAX_TOKEN, Resource, Result};
use held::{Held, HeldState, Inner, expire, remove_strays};
pub use names::zk_lock_dir;
use names::{is_owners, lock_dir, owner_stem, queue};
pub(crate) use session::is_transient;
use session::{create_lock_node, delete, ended, list, open_session, timed};
use url::parse_url;
pub use url::{ZK_SCHEME, is_zk_url};

/// Issues leases and fence tokens from a ZooKeeper ensemble (3.5 or newer; feature `zk`).
///
/// The same methods and [`Lease`] / [`ReleaseOutcome`] / [`LeaseState`] / [`LockStatus`] as
/// the Redis [`Issuer`](crate::Issuer) and the `EtcdIssuer`, and it implements
/// [`TokenIssuer`](crate::TokenIssuer) ([`IssuerKind::ZooKeeper`](crate::IssuerKind::ZooKeeper)),
/// where [`raise_floor`](crate::TokenIssuer::raise_floor) and
/// [`recover_from`](crate::TokenIssuer::recover_from) are no-ops: zxids never go backwards.
/// Cloning is cheap; clones share one ZooKeeper session.
///
/// ```no_run
/// # async fn f() -> pgfence::Result<()> {
/// use std::time::Duration;
/// let issuer = pgfence::ZkIssuer::connect("zk://10.0.0.1:2181,10.0.0.2:2181,10.0.0.3:2181").await?;
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
/// Tokens are at most [`MAX_TOKEN`](crate::MAX_TOKEN) = 2^39 − 1, so this issuer works while the
/// ensemble's epoch is below 128 (an ensemble starts at epoch 1, and each leader election adds
/// one). An acquire whose zxid would exceed it fails with [`Error::InvalidToken`] and leaves no
/// lock behind. Like the etcd issuer, zxids are ensemble-wide, so tokens compare across
/// resources, and an ensemble rebuilt empty starts low again (Postgres then rejects its tokens,
/// safely, until they pass the old ones).
///
/// # Layout
///
/// Resource `R`'s lock lives under the persistent node `/pgfence/lock/R` ([`zk_lock_dir`];
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
/// (others get [`Error::InvalidOwner`]). When the session expires, the next call opens a new
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
}

impl std::fmt::Debug for ZkIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkIssuer")
            .field("hosts", &self.inner.hosts)
            .field("session_timeout", &self.inner.session_timeout)
            .field("key_prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl ZkIssuer {
    /// Connects to the ensemble named by `url`: `zk://host[:port][,host[:port]...]` (port 2181
    /// by default), optionally `?session_timeout_ms=N` (default 10,000). Plain TCP, no auth.
    ///
    /// # Errors
    /// [`Error::InvalidIssuerUrl`] for a malformed URL; [`Error::ZooKeeper`] when no session
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
        })
    }

    /// The same issuer (same session) with another key prefix: lock nodes live under
    /// `/PREFIX/lock/R`. Issuers with different prefixes share no lock (their tokens still come
    /// from the ensemble's one zxid sequence).
    ///
    /// # Errors
    /// [`Error::InvalidKeyPrefix`], as for [`Issuer::with_key_prefix`](crate::Issuer::with_key_prefix).
    pub fn with_key_prefix(mut self, prefix: &str) -> Result<Self> {
        self.prefix = check_key_prefix(prefix)?.into();
        Ok(self)
    }

    /// The key prefix (`pgfence` by default).
    #[must_use]
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// This issuer's znode for `resource`'s lock nodes: `/PREFIX/lock/R`.
    #[must_use]
    pub fn lock_dir(&self, resource: &Resource) -> String {
        lock_dir(&self.prefix, resource)
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

    /// Tries once to take `resource`'s lock for `ttl`. `Ok(None)` when another owner holds it.
    ///
    /// # Errors
    /// [`Error::InvalidDuration`] for a TTL outside [`MIN_TTL`](crate::MIN_TTL)`..=`
    /// [`MAX_TTL`](crate::MAX_TTL) (nothing is sent); [`Error::ZooKeeper`] when ZooKeeper fails
    /// after retries; [`Error::InvalidToken`] when the ensemble's zxid reached
    /// [`MAX_TOKEN`](crate::MAX_TOKEN) (no lock node is left behind).
    pub async fn acquire(&self, resource: &Resource, ttl: Duration) -> Result<Option<Lease>> {
        policy::acquire(self, resource, ttl).await
    }

    /// Like [`ZkIssuer::acquire`] with a caller-chosen owner id. Re-running it with the same
    /// owner while this issuer holds the lock returns the same token and renews the lock for
    /// `ttl` (the idempotent retry after a lost reply). Returns `Err(retry_in)` when another
    /// owner holds the lock; ZooKeeper does not know the holder's remaining TTL, so `retry_in`
    /// is zero ("unknown").
    ///
    /// # Errors
    /// As [`ZkIssuer::acquire`]; [`Error::InvalidOwner`] for an empty owner id or one
    /// containing `:`.
    pub async fn acquire_as(
        &self,
        resource: &Resource,
        owner: &str,
        ttl: Duration,
    ) -> Result<std::result::Result<Lease, Duration>> {
        policy::acquire_as(self, resource, owner, ttl).await
    }

    /// One attempt: a listing, and a node created when the lock is free. The owner id in the
    /// node's name lets a re-sent attempt find a node an unanswered one created.
    async fn acquire_once(&self, ask: &Ask<'_>) -> Result<Attempt> {
        let (resource, owner) = (ask.resource, ask.owner);
        let dir = &self.lock_dir(resource);
        // A retry of an acquire that failed: this try adopts or removes its node itself.
        self.inner
            .strays
            .lock()
            .await
            .remove(&(dir.clone(), owner.to_owned()));
        let sent_at = Instant::now();
        let client = self.session().await?;
        let stem = owner_stem(owner);
        // A look first: a held lock costs no write to refuse.
        let (names, dir_stat) = list(&client, dir).await?;
        let nodes = queue(names);
        if let Some((_, first)) = nodes.first() {
            if !is_owners(first, &stem) {
                // Another owner holds it. A stray node of ours further back (an earlier
                // try whose reply was lost) would be taken for a waiter: remove it.
                for (_, name) in nodes.iter().skip(1).filter(|(_, n)| is_owners(n, &stem)) {
                    let _ = delete(&client, &format!("{dir}/{name}")).await;
                }
                return Ok(Attempt::Busy(Duration::ZERO));
            }
            let path = format!("{dir}/{first}");
            return self.owned_first(&client, ask, dir, &path, sent_at).await;
        }
        // Our node would be created at a zxid above every zxid of the lock dir: refuse at the
        // limit before anything is written. (Without a lock dir there is nothing to read the
        // zxid from: the node is created, and deleted again when its zxid is past the limit.)
        if let Some(stat) = dir_stat {
            let seen = stat.czxid.max(stat.mzxid).max(stat.pzxid);
            if seen >= MAX_TOKEN {
                return Err(limit_refused(resource, seen, false));
            }
        }
        let path = format!("{dir}/{stem}");
        let stat = create_lock_node(&client, dir, &path, owner).await?;
        // Our node's full name: the one of ours the listing shows.
        let nodes = queue(list(&client, dir).await?.0);
        let Some((_, mine)) = nodes.iter().find(|(_, n)| is_owners(n, &stem)) else {
            // Deleted under us (the session ended): nothing was taken.
            return Ok(Attempt::Busy(Duration::ZERO));
        };
        let mine = format!("{dir}/{mine}");
        if !nodes.first().is_some_and(|(_, n)| is_owners(n, &stem)) {
            // Someone created theirs first: they hold the lock; leave no node behind.
            delete(&client, &mine).await?;
            return Ok(Attempt::Busy(Duration::ZERO));
        }
        self.take(&client, ask, dir, mine, stat.czxid, sent_at)
            .await
            .map(Attempt::Granted)
    }

    /// The first node is `owner`'s: ours already (renew it), or a node an unanswered try of
    /// this session created (adopt it), or one of another session with the same owner id.
    async fn owned_first(
        &self,
        client: &Client,
        ask: &Ask<'_>,
        dir: &str,
        path: &str,
        sent_at: Instant,
    ) -> Result<Attempt> {
        if let Some(held) = self.held(dir, ask.owner).filter(|h| h.path == path) {
            // The same owner again: renew for the TTL asked now, as Redis's PEXPIRE does.
            if held.renew(sent_at + ask.ttl) {
                return Ok(Attempt::Granted(
                    ask.lease(FenceToken::new(held.token)?, sent_at),
                ));
            }
            return Ok(Attempt::Busy(Duration::ZERO));
        }
        let Some(stat) = timed(client.check_stat(path)).await? else {
            return Ok(Attempt::Busy(Duration::ZERO));
        };
        if stat.ephemeral_owner != client.session_id().0 {
            // Held by another session under the same owner id: not ours to extend.
            return Ok(Attempt::Busy(Duration::ZERO));
        }
        self.take(client, ask, dir, path.to_owned(), stat.czxid, sent_at)
            .await
            .map(Attempt::Granted)
    }

    /// Records `path` as the lock `ask.owner` holds, with token `czxid`, and starts its timer.
    async fn take(
        &self,
        client: &Client,
        ask: &Ask<'_>,
        dir: &str,
        path: String,
        czxid: i64,
        sent_at: Instant,
    ) -> Result<Lease> {
        let (owner, ttl) = (ask.owner, ask.ttl);
        if !(1..=MAX_TOKEN).contains(&czxid) {
            // Leave nothing behind: the lock is useless without a valid token. A delete that
            // does not get through is finished in the background (see `Inner::strays`).
            let until = Instant::now() + Duration::from_secs(2);
            let (deleted, _) =
                resend::<Self, _, _, _>(until, u32::MAX, || delete(client, &path)).await;
            if deleted.is_err() {
                self.sweep(dir, owner).await;
            }
            return Err(limit_refused(ask.resource, czxid, true));
        }
        let lease = ask.lease(FenceToken::new(czxid)?, sent_at);
        let held = Arc::new(Held {
            path,
            token: czxid,
            state: Mutex::new(HeldState {
                deadline: sent_at + ttl,
                ended: false,
            }),
            wake: Notify::new(),
        });
        let previous = self
            .held_map()
            .insert((dir.to_owned(), owner.to_owned()), held.clone());
        if let Some(previous) = previous {
            previous.end();
        }
        tokio::spawn(expire(
            Arc::downgrade(&self.inner),
            (dir.to_owned(), owner.to_owned()),
            held,
        ));
        Ok(lease)
    }

    /// Waits up to `wait` for the lock, retrying with jittered exponential backoff (10 ms
    /// doubling to 500 ms). `Ok(None)` when the wait ran out.
    ///
    /// # Errors
    /// As [`ZkIssuer::acquire`].
    pub async fn acquire_wait(
        &self,
        resource: &Resource,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Option<Lease>> {
        policy::acquire_wait(self, resource, ttl, wait).await
    }

    /// Releases the lock if `lease` still holds it (its node, same owner and token, still
    /// exists), from any issuer on the ensemble. A release lost in transit is sent again for
    /// up to 2 s; one that then finds its node gone before the lease's local deadline reports
    /// [`ReleaseOutcome::Released`] (an earlier attempt deleted it), as the other issuers do.
    ///
    /// # Errors
    /// [`Error::ZooKeeper`].
    pub async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        policy::release(self, lease).await
    }

    /// Leaves the lock nodes `owner` may have left in `dir` to a cleanup task (see
    /// `Inner::strays`), unless an acquire of the same owner takes the lock over first.
    async fn sweep(&self, dir: &str, owner: &str) {
        let key = (dir.to_owned(), owner.to_owned());
        self.inner.strays.lock().await.insert(key.clone());
        tokio::spawn(remove_strays(Arc::downgrade(&self.inner), key));
    }

    /// One release. When this issuer took the lease, its node's path is unique (sequence
    /// numbers are never reused), so deleting it is owner-safe in one round trip.
    async fn release_node(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let dir = &self.lock_dir(&lease.resource);
        let known = self
            .held(dir, &lease.owner)
            .filter(|h| h.token == lease.token.get())
            .map(|held| {
                // The timer must not delete the node after a newer lease of this owner took it.
                held.end();
                self.inner
                    .forget(&(dir.clone(), lease.owner.clone()), &held);
                held.path.clone()
            });
        let client = self.session().await?;
        if let Some(path) = known.as_deref() {
            match timed(client.delete(path, None)).await {
                Ok(()) => return Ok(ReleaseOutcome::Released),
                // Gone: expired, deleted by hand, or an earlier try's delete applied.
                Err(Error::ZooKeeper(zookeeper_client::Error::NoNode)) => {}
                Err(e) => return Err(e),
            }
        }
        match self.find(&client, dir, None, lease).await? {
            Found::Mine(path) => {
                delete(&client, &path).await?;
                Ok(ReleaseOutcome::Released)
            }
            Found::Other => Ok(ReleaseOutcome::TakenByOther),
            Found::Free => Ok(ReleaseOutcome::AlreadyExpired),
        }
    }

    /// Where `lease`'s lock node is: still there, gone with another holder, or gone and free.
    /// `known` (the node's path, when this issuer holds the lease) answers "still there" with
    /// one read instead of a listing and a read.
    async fn find(
        &self,
        client: &Client,
        dir: &str,
        known: Option<&str>,
        lease: &Lease,
    ) -> Result<Found> {
        if let Some(path) = known
            && timed(client.check_stat(path))
                .await?
                .is_some_and(|stat| stat.czxid == lease.token.get())
        {
            return Ok(Found::Mine(path.to_owned()));
        }
        let stem = owner_stem(&lease.owner);
        let nodes = queue(list(client, dir).await?.0);
        if let Some((_, name)) = nodes.first().filter(|(_, n)| is_owners(n, &stem)) {
            let path = format!("{dir}/{name}");
            if let Some(stat) = timed(client.check_stat(&path)).await?
                && stat.czxid == lease.token.get()
            {
                return Ok(Found::Mine(path));
            }
        }
        Ok(if nodes.is_empty() {
            Found::Free
        } else {
            Found::Other
        })
    }

    /// Extends the lock to `ttl` from now if `lease` still holds it, and moves the lease's
    /// local deadline accordingly. The node's existence is checked on the ensemble (one read);
    /// the deadline is this issuer's timer.
    ///
    /// # Errors
    /// [`Error::InvalidDuration`]; [`Error::ZooKeeper`]; [`Error::InvalidOwner`] when the lock
    /// is held by another session's issuer (only the issuer that acquired a lease extends it).
    pub async fn extend(&self, lease: &mut Lease, ttl: Duration) -> Result<LeaseState> {
        policy::extend(self, lease, ttl).await
    }

    /// [`ZkIssuer::extend`], re-sending after transport failures only until `until` (what
    /// [`KeepAlive`](crate::KeepAlive) uses, with the lease's local deadline).
    ///
    /// # Errors
    /// As [`ZkIssuer::extend`].
    pub async fn extend_until(
        &self,
        lease: &mut Lease,
        ttl: Duration,
        until: Instant,
    ) -> Result<LeaseState> {
        policy::extend_until(self, lease, ttl, until).await
    }

    /// One extend: the node's existence is read on the ensemble, the deadline is the timer's.
    async fn extend_node(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        let sent_at = Instant::now();
        let client = self.session().await?;
        let dir = self.lock_dir(&lease.resource);
        let held = self
            .held(&dir, &lease.owner)
            .filter(|h| h.token == lease.token.get());
        let known = held.as_ref().map(|h| h.path.as_str());
        let path = match self.find(&client, &dir, known, lease).await? {
            Found::Mine(path) => path,
            Found::Other => return Ok(Renewal::Taken),
            Found::Free => return Ok(Renewal::Expired),
        };
        match held {
            Some(held) if held.path == path => {
                if held.renew(sent_at + ttl) {
                    Ok(Renewal::Held(sent_at + ttl))
                } else {
                    // The timer ended it between the read and now: its delete is under way.
                    Ok(Renewal::Expired)
                }
            }
            _ => Err(Error::InvalidOwner(format!(
                "the ZooKeeper lock of {} (token {}) belongs to another session; only the issuer that acquired it can extend it",
                lease.resource, lease.token
            ))),
        }
    }

    /// Reads `resource`'s lock. `counter` is the zxid of the last change to the resource's lock
    /// nodes (every token issued for it so far is at most this; the next is above it). `ttl_ms`
    /// is known only for locks this issuer holds.
    ///
    /// # Errors
    /// [`Error::ZooKeeper`].
    pub async fn status(&self, resource: &Resource) -> Result<LockStatus> {
        policy::status(self, resource).await
    }

    /// One read of the lock dir, and of its first node.
    async fn read_status(&self, resource: &Resource) -> Result<LockStatus> {
        let client = self.session().await?;
        let dir = self.lock_dir(resource);
        let (names, dir_stat) = list(&client, &dir).await?;
        let counter = dir_stat.map_or(0, |s| s.pzxid);
        let mut status = LockStatus {
            resource: resource.to_string(),
            owner: None,
            token: None,
            ttl_ms: None,
            counter,
        };
        if let Some((_, first)) = queue(names).first() {
            let path = format!("{dir}/{first}");
            match timed(client.get_data(&path)).await {
                Ok((data, stat)) => {
                    let owner = String::from_utf8_lossy(&data).into_owned();
                    status.ttl_ms = self.held(&dir, &owner).filter(|h| h.path == path).map(|h| {
                        let left = h.lock().deadline.saturating_duration_since(Instant::now());
                        i64::try_from(left.as_millis()).unwrap_or(i64::MAX)
                    });
                    status.owner = Some(owner);
                    status.token = Some(stat.czxid);
                }
                Err(Error::ZooKeeper(zookeeper_client::Error::NoNode)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(status)
    }

    /// Keeps `lease` alive in the background; see [`KeepAlive`](crate::KeepAlive).
    #[must_use]
    pub fn keep_alive(&self, lease: &Lease) -> crate::KeepAlive {
        crate::KeepAlive::spawn(Arc::new(self.clone()), lease.clone())
    }
}

/// Zxids never go backwards: nothing to raise, nothing to reseed (the defaults).
impl Backend for ZkIssuer {
    const KIND: IssuerKind = IssuerKind::ZooKeeper;
    const RESEND: Resend = PATIENT;

    fn key_prefix(&self) -> &str {
        &self.prefix
    }

    async fn try_acquire(&self, ask: &Ask<'_>) -> Result<Attempt> {
        self.acquire_once(ask).await
    }

    /// A create or a delete whose reply was lost may have left the owner's node, holding the
    /// lock with no timer until the session ends: removed in the background.
    async fn abandoned(&self, resource: &Resource, owner: &str) {
        self.sweep(&self.lock_dir(resource), owner).await;
    }

    async fn release_once(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        self.release_node(lease).await
    }

    async fn extend_once(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        self.extend_node(lease, ttl).await
    }

    async fn status_once(&self, resource: &Resource) -> Result<LockStatus> {
        self.read_status(resource).await
    }
}

/// The refusal at the token limit: the ensemble's zxid is at `zxid`.
fn limit_refused(resource: &Resource, zxid: i64, undone: bool) -> Error {
    policy::limit_refused(
        resource,
        &format!(
            "the ZooKeeper ensemble's zxid, its token counter (at {zxid}, epoch {}),",
            zxid >> 32
        ),
        "zxids never go backwards (the epoch counts leader elections, and epoch 128 is past the limit), so this ensemble can issue no more tokens",
        undone,
    )
}

enum Found {
    Mine(String),
    Other,
    Free,
}
