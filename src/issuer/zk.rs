//! The ZooKeeper issuer (feature `zk`): a lock is an ephemeral sequential znode under the
//! resource's node; its fence token is the zxid that created it.
//!
//! The design is documented on [`ZkIssuer`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use zookeeper_client::{Acls, Client, CreateMode, SessionState, Stat};

use super::{
    ACQUIRE_ATTEMPTS, DEFAULT_KEY_PREFIX, Lease, LeaseState, LockStatus, ReleaseOutcome,
    acquire_waiting, check_key_prefix, check_ttl, host_list, new_owner_id, retrying,
};
use crate::tls::zk_tls_unsupported as tls_unsupported;
use crate::{Error, FenceToken, MAX_TOKEN, Resource, Result};

/// The URL scheme that selects the ZooKeeper issuer: `zk://host:2181[,host2:2181...]`.
pub const ZK_SCHEME: &str = "zk://";

/// The port used when a `zk://` URL names a host without one.
const DEFAULT_PORT: u16 = 2181;

/// The session timeout asked of the servers unless the URL sets `session_timeout_ms`.
const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// How long connecting may take before [`ZkIssuer::connect`] gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one request may wait for its reply (the client re-sends nothing by itself).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The name every lock node starts with; then the owner id and `-`, then ZooKeeper's sequence.
const NODE_PREFIX: &str = "lock-";

/// Whether `url` selects the ZooKeeper issuer (`zk://...`).
#[must_use]
pub fn is_zk_url(url: &str) -> bool {
    url.get(..ZK_SCHEME.len())
        .is_some_and(|s| s.eq_ignore_ascii_case(ZK_SCHEME))
}

/// The znode under which `resource`'s lock nodes are created, with the default key prefix:
/// `/pgfence/lock/<resource>`, the resource name with `%`, `/` and characters ZooKeeper does
/// not allow in a node name written as `%XX` (so `a/b` is `/pgfence/lock/a%2Fb`).
#[must_use]
pub fn zk_lock_dir(resource: &Resource) -> String {
    lock_dir(DEFAULT_KEY_PREFIX, resource)
}

fn lock_dir(prefix: &str, resource: &Resource) -> String {
    format!(
        "/{}/lock/{}",
        node_name(prefix),
        node_name(resource.as_str())
    )
}

/// `s` as one znode name: ASCII letters, digits and `-_.:{}@+=,!~*()'` as they are, every
/// other byte as `%XX`; a name of dots only (`.`, `..`) has its dots encoded. Injective, since
/// `%` itself is encoded.
fn node_name(s: &str) -> String {
    use std::fmt::Write as _;
    let all_dots = s.bytes().all(|b| b == b'.');
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        let plain = b.is_ascii_alphanumeric()
            || (b"-_:{}@+=,!~*()'".contains(&b))
            || (b == b'.' && !all_dots);
        if plain {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The sequence number at the end of a lock node's name (`None` for a foreign node).
fn sequence_of(name: &str) -> Option<i64> {
    let (_, digits) = name.rsplit_once('-')?;
    if !name.starts_with(NODE_PREFIX) || digits.is_empty() {
        return None;
    }
    digits.parse().ok()
}

/// The lock nodes of a directory listing, lowest sequence (the holder) first.
fn queue(mut names: Vec<String>) -> Vec<(i64, String)> {
    let mut nodes: Vec<(i64, String)> = names
        .drain(..)
        .filter_map(|n| sequence_of(&n).map(|s| (s, n)))
        .collect();
    nodes.sort_unstable();
    nodes
}

/// The name `owner`'s lock node starts with (ZooKeeper appends the sequence).
fn owner_stem(owner: &str) -> String {
    format!("{NODE_PREFIX}{}-", node_name(owner))
}

/// Whether lock node `name` was created for `owner`.
fn is_owners(name: &str, stem: &str) -> bool {
    name.strip_prefix(stem)
        .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
}

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

struct Inner {
    /// `host:port,...` as the client takes it.
    hosts: String,
    session_timeout: Duration,
    client: Mutex<Client>,
    /// Serialises replacing an expired session.
    reconnecting: tokio::sync::Mutex<()>,
    /// (lock dir, owner id) of acquires that failed after a create whose reply was lost: a
    /// node of theirs may exist, holding the lock with no timer. A cleanup task deletes such
    /// nodes unless an acquire of the same owner (an idempotent retry) takes the key first;
    /// the mutex makes the two exclusive.
    strays: tokio::sync::Mutex<std::collections::HashSet<(String, String)>>,
    /// The leases this issuer holds, by (lock dir, owner id).
    held: Mutex<HashMap<(String, String), Arc<Held>>>,
}

impl Inner {
    /// The current session's client.
    fn current(&self) -> Client {
        self.client
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Drops `held` from the map if it is still the entry for `key` (a newer lease of the same
    /// owner may have replaced it).
    fn forget(&self, key: &(String, String), held: &Arc<Held>) {
        let mut map = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if map.get(key).is_some_and(|h| Arc::ptr_eq(h, held)) {
            map.remove(key);
        }
    }
}

/// A lock this issuer holds, and its timer's state.
struct Held {
    path: String,
    token: i64,
    state: Mutex<HeldState>,
    /// Wakes the timer when the deadline moves or the lease ends.
    wake: Notify,
}

struct HeldState {
    deadline: Instant,
    ended: bool,
}

impl Held {
    fn lock(&self) -> std::sync::MutexGuard<'_, HeldState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the deadline if the lease has not ended (false when it has).
    fn renew(&self, deadline: Instant) -> bool {
        let mut state = self.lock();
        if state.ended {
            return false;
        }
        state.deadline = deadline;
        drop(state);
        self.wake.notify_one();
        true
    }

    /// Ends the lease (the timer stops); false when it had already ended.
    fn end(&self) -> bool {
        let mut state = self.lock();
        let was = !state.ended;
        state.ended = true;
        drop(state);
        self.wake.notify_one();
        was
    }
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
                strays: tokio::sync::Mutex::new(std::collections::HashSet::new()),
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
        Ok(self.acquire_as(resource, &new_owner_id(), ttl).await?.ok())
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
        check_ttl(ttl)?;
        super::check_owner(owner)?;
        let fencing = super::fencing_name(&self.prefix, resource)?;
        let dir = self.lock_dir(resource);
        let key = (dir.clone(), owner.to_owned());
        // A retry of an acquire that failed: this try adopts or removes its node itself.
        self.inner.strays.lock().await.remove(&key);
        let mut attempt = 0;
        loop {
            match self.try_acquire(resource, &dir, owner, ttl).await {
                Ok(outcome) => return Ok(outcome.map(|l| l.fenced_as(fencing.clone()))),
                // The same owner id lets the next try find a node this one may have created.
                Err(e) if attempt + 1 < ACQUIRE_ATTEMPTS && e.is_retryable() => {
                    tokio::time::sleep(Duration::from_millis(25 << attempt)).await;
                    attempt += 1;
                }
                Err(e) => {
                    if e.is_retryable() {
                        // A create whose reply was lost may have left our node: remove it in
                        // the background, so it does not hold the lock until the session ends.
                        self.inner.strays.lock().await.insert(key.clone());
                        tokio::spawn(remove_strays(Arc::downgrade(&self.inner), key));
                    }
                    return Err(e);
                }
            }
        }
    }

    async fn try_acquire(
        &self,
        resource: &Resource,
        dir: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<std::result::Result<Lease, Duration>> {
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
                return Ok(Err(Duration::ZERO));
            }
            let path = format!("{dir}/{first}");
            return self
                .owned_first(&client, resource, dir, owner, &path, ttl, sent_at)
                .await;
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
            return Ok(Err(Duration::ZERO));
        };
        let mine = format!("{dir}/{mine}");
        if !nodes.first().is_some_and(|(_, n)| is_owners(n, &stem)) {
            // Someone created theirs first: they hold the lock; leave no node behind.
            delete(&client, &mine).await?;
            return Ok(Err(Duration::ZERO));
        }
        self.take(
            &client, resource, dir, owner, mine, stat.czxid, ttl, sent_at,
        )
        .await
        .map(Ok)
    }

    /// The first node is `owner`'s: ours already (renew it), or a node an unanswered try of
    /// this session created (adopt it), or one of another session with the same owner id.
    #[allow(clippy::too_many_arguments)]
    async fn owned_first(
        &self,
        client: &Client,
        resource: &Resource,
        dir: &str,
        owner: &str,
        path: &str,
        ttl: Duration,
        sent_at: Instant,
    ) -> Result<std::result::Result<Lease, Duration>> {
        if let Some(held) = self.held(dir, owner).filter(|h| h.path == path) {
            // The same owner again: renew for the TTL asked now, as Redis's PEXPIRE does.
            if held.renew(sent_at + ttl) {
                return Ok(Ok(lease(resource, owner, held.token, ttl, sent_at)?));
            }
            return Ok(Err(Duration::ZERO));
        }
        let Some(stat) = timed(client.check_stat(path)).await? else {
            return Ok(Err(Duration::ZERO));
        };
        if stat.ephemeral_owner != client.session_id().0 {
            // Held by another session under the same owner id: not ours to extend.
            return Ok(Err(Duration::ZERO));
        }
        self.take(
            client,
            resource,
            dir,
            owner,
            path.to_owned(),
            stat.czxid,
            ttl,
            sent_at,
        )
        .await
        .map(Ok)
    }

    /// Records `path` as the lock `owner` holds, with token `czxid`, and starts its timer.
    #[allow(clippy::too_many_arguments)]
    async fn take(
        &self,
        client: &Client,
        resource: &Resource,
        dir: &str,
        owner: &str,
        path: String,
        czxid: i64,
        ttl: Duration,
        sent_at: Instant,
    ) -> Result<Lease> {
        if !(1..=MAX_TOKEN).contains(&czxid) {
            // Leave nothing behind: the lock is useless without a valid token. A delete that
            // does not get through is finished in the background (see `Inner::strays`).
            let until = Instant::now() + Duration::from_secs(2);
            let (deleted, _) = retrying(until, || delete(client, &path)).await;
            if deleted.is_err() {
                let key = (dir.to_owned(), owner.to_owned());
                self.inner.strays.lock().await.insert(key.clone());
                tokio::spawn(remove_strays(Arc::downgrade(&self.inner), key));
            }
            return Err(limit_refused(resource, czxid, true));
        }
        let lease = lease(resource, owner, czxid, ttl, sent_at)?;
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
        acquire_waiting(ttl, wait, |owner| async move {
            self.acquire_as(resource, &owner, ttl).await
        })
        .await
    }

    /// Releases the lock if `lease` still holds it (its node, same owner and token, still
    /// exists), from any issuer on the ensemble. A release lost in transit is sent again for
    /// up to 2 s; one that then finds its node gone before the lease's local deadline reports
    /// [`ReleaseOutcome::Released`] (an earlier attempt deleted it), as the other issuers do.
    ///
    /// # Errors
    /// [`Error::ZooKeeper`].
    pub async fn release(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let dir = self.lock_dir(&lease.resource);
        let known = self
            .held(&dir, &lease.owner)
            .filter(|h| h.token == lease.token.get())
            .map(|held| {
                // The timer must not delete the node after a newer lease of this owner took it.
                held.end();
                self.inner
                    .forget(&(dir.clone(), lease.owner.clone()), &held);
                held.path.clone()
            });
        let until = Instant::now() + Duration::from_secs(2);
        let (outcome, retried) =
            retrying(until, || self.release_once(&dir, known.as_deref(), lease)).await;
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(e) => {
                if e.is_retryable() {
                    // The node may still be there, with its timer stopped: delete it in the
                    // background (unless an acquire of this owner takes it over).
                    let key = (dir, lease.owner.clone());
                    self.inner.strays.lock().await.insert(key.clone());
                    tokio::spawn(remove_strays(Arc::downgrade(&self.inner), key));
                }
                return Err(e);
            }
        };
        Ok(outcome.after_resend(retried, lease))
    }

    /// One release. `known` is the lease's node when this issuer took it: its path is unique
    /// (sequence numbers are never reused), so deleting it is owner-safe in one round trip.
    async fn release_once(
        &self,
        dir: &str,
        known: Option<&str>,
        lease: &Lease,
    ) -> Result<ReleaseOutcome> {
        let client = self.session().await?;
        if let Some(path) = known {
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
        let until = lease.deadline.max(Instant::now() + Duration::from_secs(2));
        self.extend_until(lease, ttl, until).await
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
        check_ttl(ttl)?;
        let (outcome, _) = retrying(until, || self.extend_once(lease, ttl)).await;
        let (state, deadline) = outcome?;
        if let Some(deadline) = deadline {
            lease.ttl = ttl;
            lease.deadline = deadline;
        }
        Ok(state)
    }

    async fn extend_once(
        &self,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<(LeaseState, Option<Instant>)> {
        let sent_at = Instant::now();
        let client = self.session().await?;
        let dir = self.lock_dir(&lease.resource);
        let held = self
            .held(&dir, &lease.owner)
            .filter(|h| h.token == lease.token.get());
        let known = held.as_ref().map(|h| h.path.as_str());
        let path = match self.find(&client, &dir, known, lease).await? {
            Found::Mine(path) => path,
            Found::Other => return Ok((LeaseState::Taken, None)),
            Found::Free => return Ok((LeaseState::Expired, None)),
        };
        match held {
            Some(held) if held.path == path => {
                if held.renew(sent_at + ttl) {
                    Ok((LeaseState::Held, Some(sent_at + ttl)))
                } else {
                    // The timer ended it between the read and now: its delete is under way.
                    Ok((LeaseState::Expired, None))
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

/// The refusal at the token limit: the ensemble's zxid is at `zxid`.
fn limit_refused(resource: &Resource, zxid: i64, undone: bool) -> Error {
    super::limit_refused(
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

fn lease(
    resource: &Resource,
    owner: &str,
    token: i64,
    ttl: Duration,
    sent_at: Instant,
) -> Result<Lease> {
    Ok(Lease {
        timeline: crate::timeline::Binding::default(),
        resource: resource.clone(),
        fencing: resource.clone(),
        owner: owner.to_owned(),
        token: FenceToken::new(token)?,
        ttl,
        deadline: sent_at + ttl,
    })
}

/// Deletes the lock nodes `key`'s owner may have left in `key`'s dir after a failed acquire
/// (see `Inner::strays`), retrying for up to twice the session timeout (by then the session has
/// ended, and the ensemble has deleted them, or the connection is back). Stops when an acquire
/// of the same owner took the key over, or the issuer is gone.
async fn remove_strays(inner: Weak<Inner>, key: (String, String)) {
    let started = Instant::now();
    let mut backoff = Duration::from_millis(50);
    loop {
        let Some(inner) = inner.upgrade() else {
            return;
        };
        {
            let mut strays = inner.strays.lock().await;
            if !strays.contains(&key) {
                return;
            }
            let client = inner.current();
            if ended(client.state()) {
                strays.remove(&key);
                return;
            }
            let (dir, owner) = &key;
            let stem = owner_stem(owner);
            let kept = inner
                .held
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&key)
                .map(|h| h.path.clone());
            let done = match list(&client, dir).await {
                Ok((names, _)) => {
                    let mut all = true;
                    for name in names.iter().filter(|n| is_owners(n, &stem)) {
                        let path = format!("{dir}/{name}");
                        if kept.as_deref() != Some(path.as_str()) {
                            all &= delete(&client, &path).await.is_ok();
                        }
                    }
                    all
                }
                Err(_) => false,
            };
            if done || started.elapsed() > inner.session_timeout * 2 {
                strays.remove(&key);
                return;
            }
        }
        drop(inner);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// A lease's timer: deletes its node when the deadline passes without a renewal; stops when
/// the lease ends (released, replaced) or the issuer is gone (its session then closes).
async fn expire(inner: Weak<Inner>, key: (String, String), held: Arc<Held>) {
    loop {
        let deadline = {
            let state = held.lock();
            if state.ended {
                return;
            }
            state.deadline
        };
        tokio::select! {
            () = tokio::time::sleep_until(deadline) => {}
            () = held.wake.notified() => continue,
        }
        {
            let mut state = held.lock();
            if state.ended {
                return;
            }
            if Instant::now() < state.deadline {
                continue;
            }
            state.ended = true;
        }
        let Some(inner) = inner.upgrade() else {
            return;
        };
        inner.forget(&key, &held);
        let client = inner.current();
        if ended(client.state()) {
            // The session is over: the ensemble deleted its nodes.
            return;
        }
        // Re-sent while the connection is down; if the session ends meanwhile, the ensemble
        // deletes the node itself.
        let until = Instant::now() + inner.session_timeout;
        let (outcome, _) = retrying(until, || delete(&client, &held.path)).await;
        if let Err(e) = outcome {
            tracing::warn!(target: "pgfence::issuer", node = %held.path, error = %e, "could not delete an expired ZooKeeper lock node; it ends with the session");
        }
        return;
    }
}

fn ended(state: SessionState) -> bool {
    matches!(
        state,
        SessionState::Expired | SessionState::Closed | SessionState::AuthFailed
    )
}

async fn open_session(hosts: &str, session_timeout: Duration) -> Result<Client> {
    let connect = Client::connector()
        .with_session_timeout(session_timeout)
        .connect(hosts);
    match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
        Ok(client) => Ok(client?),
        Err(_) => Err(Error::ZooKeeper(zookeeper_client::Error::Timeout)),
    }
}

/// One request with [`REQUEST_TIMEOUT`] (a timeout is [`zookeeper_client::Error::Timeout`]).
async fn timed<T>(
    request: impl std::future::Future<Output = std::result::Result<T, zookeeper_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
        Ok(reply) => Ok(reply?),
        Err(_) => Err(Error::ZooKeeper(zookeeper_client::Error::Timeout)),
    }
}

/// `dir`'s children and its stat; none when it does not exist.
async fn list(client: &Client, dir: &str) -> Result<(Vec<String>, Option<Stat>)> {
    match timed(client.get_children(dir)).await {
        Ok((names, stat)) => Ok((names, Some(stat))),
        Err(Error::ZooKeeper(zookeeper_client::Error::NoNode)) => Ok((Vec::new(), None)),
        Err(e) => Err(e),
    }
}

/// Deletes a node; one that is already gone is fine.
async fn delete(client: &Client, path: &str) -> Result<()> {
    match timed(client.delete(path, None)).await {
        Ok(()) | Err(Error::ZooKeeper(zookeeper_client::Error::NoNode)) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Creates `owner`'s ephemeral sequential node (`stem` + sequence) in `dir`, creating `dir`
/// (a container) and its parents first when missing.
async fn create_lock_node(client: &Client, dir: &str, stem: &str, owner: &str) -> Result<Stat> {
    let node = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
    let container = CreateMode::Container.with_acls(Acls::anyone_all());
    let mut tries = 0;
    loop {
        match timed(client.create(stem, owner.as_bytes(), &node)).await {
            Ok((stat, _)) => return Ok(stat),
            // The container may be reaped between the mkdir and the create: try again.
            Err(Error::ZooKeeper(zookeeper_client::Error::NoNode)) if tries < 3 => {
                tries += 1;
                timed(client.mkdir(dir, &container)).await?;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Query parameters that ask for TLS, which this issuer does not speak (see [`ZkIssuer`]).
const TLS_PARAMS: [&str; 6] = ["tls", "ssl", "secure", "cacert", "cert", "key"];

/// `zk://host[:port][,host[:port]...][/][?session_timeout_ms=N]` → the client's host list and
/// the session timeout.
fn parse_url(url: &str) -> Result<(String, Duration)> {
    let invalid = |why: &str| {
        Error::InvalidIssuerUrl(format!(
            "{why} (expected zk://host:port[,host:port...][?session_timeout_ms=N])"
        ))
    };
    if crate::tls::is_zk_tls_url(url) {
        return Err(tls_unsupported());
    }
    if !is_zk_url(url) {
        return Err(invalid("not a zk:// URL"));
    }
    let rest = &url[ZK_SCHEME.len()..];
    let (hosts, query) = rest.split_once('?').unwrap_or((rest, ""));
    let hosts = hosts.strip_suffix('/').unwrap_or(hosts);
    let mut session_timeout = DEFAULT_SESSION_TIMEOUT;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("session_timeout_ms", ms)) => {
                let ms: u64 = ms
                    .parse()
                    .ok()
                    .filter(|ms| *ms > 0)
                    .ok_or_else(|| invalid("session_timeout_ms is a positive number"))?;
                session_timeout = Duration::from_millis(ms);
            }
            Some((name, _)) if TLS_PARAMS.contains(&name) => return Err(tls_unsupported()),
            None if TLS_PARAMS.contains(&pair) => return Err(tls_unsupported()),
            _ => return Err(invalid("unknown parameter")),
        }
    }
    let hosts = host_list(hosts, DEFAULT_PORT).map_err(invalid)?;
    Ok((hosts.join(","), session_timeout))
}

/// Whether a ZooKeeper error is transient: the connection (including the I/O errors the client
/// reports as custom errors, such as a reset by a server that died), a timeout, throttling, or
/// a session that ended (the next call opens a new one).
pub(crate) fn is_transient(e: &zookeeper_client::Error) -> bool {
    use zookeeper_client::Error as Zk;
    match e {
        Zk::ConnectionLoss
        | Zk::Timeout
        | Zk::NoHosts
        | Zk::Throttled
        | Zk::SessionMoved
        | Zk::SessionExpired
        | Zk::ClientClosed => true,
        Zk::Custom(custom) => {
            let mut source: Option<&(dyn std::error::Error + 'static)> = Some(custom);
            while let Some(err) = source {
                // The client keeps its sources as `Arc<dyn Error>`: look inside the `Arc`.
                let shared = err
                    .downcast_ref::<Arc<dyn std::error::Error + Send + Sync>>()
                    .is_some_and(|inner| inner.is::<std::io::Error>());
                if shared || err.is::<std::io::Error>() {
                    return true;
                }
                source = err.source();
            }
            false
        }
        _ => false,
    }
}

impl From<zookeeper_client::Error> for Error {
    fn from(e: zookeeper_client::Error) -> Self {
        Error::ZooKeeper(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_zk_urls() {
        let (hosts, timeout) = parse_url("zk://127.0.0.1:2181,10.0.0.2,[::1]:3000/").unwrap();
        assert_eq!(hosts, "127.0.0.1:2181,10.0.0.2:2181,[::1]:3000");
        assert_eq!(timeout, DEFAULT_SESSION_TIMEOUT);
        let (hosts, timeout) = parse_url("ZK://h1:1,h2:2?session_timeout_ms=4000").unwrap();
        assert_eq!(hosts, "h1:1,h2:2");
        assert_eq!(timeout, Duration::from_millis(4000));
        for bad in [
            "redis://h",
            "zk://",
            "zk://h:x",
            "zk://a,,b",
            "zk://h/chroot",
            "zk://h?session_timeout_ms=0",
            "zk://h?foo=1",
            "zk://u:p@h",
        ] {
            let err = parse_url(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidIssuerUrl(_)), "{bad}: {err}");
        }
        for tls in [
            "zks://h:2281",
            "ZK+TLS://h",
            "zk://h?tls",
            "zk://h?secure=true",
            "zk://h?session_timeout_ms=4000&cacert=/ca.pem",
        ] {
            let err = parse_url(tls).unwrap_err();
            assert!(matches!(err, Error::TlsUnsupported { .. }), "{tls}: {err}");
            assert!(err.to_string().contains("TLS tunnel"), "{tls}: {err}");
        }
        assert!(is_zk_url("zk://h") && !is_zk_url("etcd://h") && !is_zk_url("z"));
    }

    #[test]
    fn node_names_are_safe_and_injective() {
        let r = Resource::in_domain("billing", "account:2").unwrap();
        assert_eq!(zk_lock_dir(&r), "/pgfence/lock/{billing}account:2");
        let r = Resource::new("a/b%c..d").unwrap();
        assert_eq!(zk_lock_dir(&r), "/pgfence/lock/a%2Fb%25c..d");
        assert_eq!(node_name(".."), "%2E%2E");
        assert_eq!(node_name("."), "%2E");
        assert_eq!(node_name("é"), "%C3%A9");
        assert_ne!(node_name("a/b"), node_name("a%2Fb"));
        assert_eq!(
            lock_dir("app/x", &Resource::new("r").unwrap()),
            "/app%2Fx/lock/r"
        );
    }

    #[test]
    fn lock_nodes_sort_by_sequence_and_belong_to_their_owner() {
        let names = vec![
            "lock-b-0000000010".to_owned(),
            "lock-a-b-0000000002".to_owned(),
            "stray".to_owned(),
            "lock-a-0000000003".to_owned(),
        ];
        let q = queue(names);
        assert_eq!(q.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [2, 3, 10]);
        let stem = owner_stem("a");
        assert!(is_owners("lock-a-0000000003", &stem));
        assert!(!is_owners("lock-a-b-0000000002", &stem));
        assert!(is_owners("lock-a-b-0000000002", &owner_stem("a-b")));
        assert!(!is_owners("lock-a-", &stem));
    }
}
