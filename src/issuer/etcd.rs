//! The etcd issuer (feature `etcd`): a lock is a key under an etcd lease, its fence token is
//! the revision etcd assigned when the key was created.
//!
//! The design is documented on [`EtcdIssuer`].

use crate::error::InvalidInput;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse,
    TxnResponse,
};
use tokio::time::Instant;

use super::idle::IssuerState;
use super::keys::{DEFAULT_KEY_PREFIX, check_key_prefix};
use super::lease::check_ttl;
use super::methods::issuer_methods;
use super::policy::{self, Ask, Attempt, Backend, DEFAULT_CALL_TIMEOUT, PATIENT, Renewal, Resend};
use super::token_issuer::IssuerKind;
use super::url::host_list;
use super::{Lease, LeaseState, LockStatus, ReleaseOutcome};
use crate::tls::{TlsParams, has_scheme};
use crate::{Error, FenceToken, Resource, Result, token::MAX_TOKEN};

/// The URL scheme that selects the etcd issuer: `etcd://host:2379[,host2:2379...]`.
pub const SCHEME: &str = "etcd://";

/// The URL scheme that selects the etcd issuer over TLS (feature `tls`):
/// `etcd+https://host:2379[,host2:2379...][?cacert=PATH&cert=PATH&key=PATH]`.
pub const TLS_SCHEME: &str = "etcd+https://";

/// The port used when an `etcd://` URL names a host without one.
const DEFAULT_PORT: u16 = 2379;

/// The etcd key of `resource`'s lock with the default key prefix: `pgfence/lock/<resource>`
/// (the resource name as is, `{domain}` prefix included). [`EtcdIssuer::lock_key`] gives an
/// issuer's key, whatever its prefix.
#[must_use]
pub fn lock_key(resource: &Resource) -> String {
    prefixed_key(DEFAULT_KEY_PREFIX, resource)
}

fn prefixed_key(prefix: &str, resource: &Resource) -> String {
    format!("{prefix}/lock/{resource}")
}

/// Issues leases and fence tokens from an etcd cluster (v3 API; etcd 3.4 or newer; feature
/// `etcd`).
///
/// The same methods and [`Lease`] / [`ReleaseOutcome`] / [`LeaseState`] / [`LockStatus`] as
/// [`RedisIssuer`](crate::RedisIssuer), so a lease from either is fenced the same way by
/// Postgres. The token is the etcd revision that created the lock key: strictly increasing
/// across the whole cluster and across leader failovers, at most [`MAX_TOKEN`] (an acquire
/// that would exceed it fails with [`InvalidInput::Token`] and leaves no lock behind).
/// Cloning is cheap; clones share the connections. It implements
/// [`TokenIssuer`](crate::TokenIssuer), where [`raise_floor`](crate::TokenIssuer::raise_floor)
/// and [`recover_from`](crate::TokenIssuer::recover_from) are no-ops (revisions never go
/// backwards).
///
/// ```no_run
/// # async fn f() -> pgfence::Result<()> {
/// use std::time::Duration;
/// let issuer = pgfence::issuer::EtcdIssuer::connect("etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379").await?;
/// let resource = pgfence::Resource::new("payments:batch:42")?;
/// if let Some(lease) = issuer.acquire(&resource, Duration::from_secs(30)).await? {
///     println!("token {}", lease.token()); // an etcd revision
///     issuer.release(&lease).await?;
/// }
/// # Ok(()) }
/// ```
///
/// # Why revisions
///
/// Every write to an etcd cluster gets the next **revision**, one counter for the whole
/// cluster, replicated by Raft with the write itself. A revision a client has seen committed
/// survives the loss of any minority of members, the leader included, so the token "counter"
/// can never go backwards the way a Redis `INCR` can after an asynchronous failover: tokens
/// issued after a failover are above every token issued before it, and Postgres fencing works
/// unchanged with nothing to reseed, and two leases never share a token
/// ([`Error::DuplicateToken`] cannot come from this issuer). Only a cluster rebuilt empty (not
/// restored from a snapshot, which keeps revisions) starts again at revision 1: Postgres then
/// rejects its tokens as stale, safely, until its revision passes the old cluster's.
///
/// # Layout
///
/// The lock of resource `R` is the key `pgfence/lock/R` ([`lock_key`];
/// `PREFIX/lock/R` with [`EtcdIssuer::with_key_prefix`]); its value is the
/// owner id and it is attached to an etcd lease granted for the lock's TTL. A lease's token is
/// the key's `create_revision`. Taking the lock is one transaction:
/// `If(CreateRevision(key) == 0) Then(Put(key, owner, lease))`. Release and extend compare
/// both the value (owner) and the `create_revision` (token), so only the lease that took the
/// lock can release or extend it: an older lease of the same owner is told
/// [`ReleaseOutcome::TakenByOther`] / [`LeaseState::Taken`].
///
/// # A failed acquire
///
/// An acquire call that returns no lease (an error, or busy) after an attempt whose outcome is
/// unknown (cut off by the call bound, or lost with its connection) revokes, in the
/// background, the etcd leases that call granted: a transaction of it that took the lock, or
/// takes it when delivered late, then leaves no lock that nobody holds. A later call of the
/// same owner that finds the lock moves it to a new etcd lease of its own, so the revoke never
/// removes a lease that was handed out. See `docs/issuers.md`, "Time bounds".
///
/// # Fencing domains
///
/// Revisions are cluster-wide, so tokens from this issuer compare across **all** resources:
/// a newer lease of any resource has a larger token than an older lease of any other. Each
/// resource (with or without a `{domain}` prefix) still has its own lock; a domain needs no
/// shared counter here, but keep using domains for resources that write the same rows, so that
/// a switch between issuers keeps working.
///
/// # TTLs
///
/// etcd leases count whole seconds: a TTL is rounded **up** to whole seconds (at least 1 s),
/// and the server raises it to its minimum lease TTL (1.5 × the election timeout, rounded up:
/// 2 s with etcd's defaults). The lock may therefore outlive the TTL asked for; it never
/// expires before it. [`Lease::deadline`] stays measured from the TTL asked for, so it errs
/// early, as with Redis. etcd also expires leases lazily (its lessor checks about twice a
/// second) and renews every lease when a new leader is elected, so a lock can be held up to
/// an election timeout longer after a failover.
#[derive(Clone)]
pub struct EtcdIssuer {
    client: Client,
    endpoints: Vec<String>,
    prefix: std::sync::Arc<str>,
    call_timeout: Duration,
    /// The etcd leases of the acquire calls in flight (shared by clones).
    grants: Arc<Grants>,
}

impl std::fmt::Debug for EtcdIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdIssuer")
            .field("endpoints", &self.endpoints)
            .field("key_prefix", &self.prefix)
            .field("call_timeout", &self.call_timeout)
            .finish_non_exhaustive()
    }
}

/// How long connecting to an endpoint may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long one request may take (a request to a member that lost its leader fails sooner:
/// every request requires a leader).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

impl EtcdIssuer {
    /// Connects to the cluster named by `url`: `etcd://host[:port][,host[:port]...]`
    /// (port 2379 by default), with optional credentials `etcd://user:password@host,...`.
    /// Plain HTTP/2. Requests are spread over the endpoints and fail over between them.
    ///
    /// # TLS
    ///
    /// `etcd+https://host[:port][,...]` (feature `tls`) speaks HTTP/2 over TLS to every
    /// endpoint, verifying the members' certificates against the system trust store, or only
    /// against the CA file of the query parameter `cacert=PATH`. `cert=PATH&key=PATH` present a
    /// client certificate (for members started with `--client-cert-auth`; etcd then takes the
    /// certificate's CN as the user when the URL names none). The parameters are named as
    /// `etcdctl`'s flags, percent-decoded, read when connecting, and refused on `etcd://`:
    ///
    /// ```text
    /// etcd+https://10.0.0.1:2379,10.0.0.2:2379?cacert=/etc/pgfence/etcd-ca.pem&cert=/etc/pgfence/etcd-client.pem&key=/etc/pgfence/etcd-client.key
    /// ```
    ///
    /// # Errors
    /// [`InvalidInput::IssuerUrl`] for a malformed URL; [`Error::Backend`] for an unreachable
    /// cluster;
    /// [`InvalidInput::Tls`] / [`InvalidInput::TlsFile`] for the TLS parameters;
    /// [`Error::IssuerNotBuilt`] for `etcd+https://` without the `tls` feature.
    pub async fn connect(url: &str) -> Result<Self> {
        let EtcdUrl {
            user,
            endpoints,
            tls,
        } = parse_url(url)?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_require_leader(true);
        if let Some((name, password)) = user {
            options = options.with_user(name, password);
        }
        if let Some(tls) = tls {
            options = with_tls(options, &tls)?;
        }
        let client = Client::connect(&endpoints, Some(options)).await?;
        Ok(Self {
            client,
            endpoints,
            prefix: DEFAULT_KEY_PREFIX.into(),
            call_timeout: DEFAULT_CALL_TIMEOUT,
            grants: Arc::default(),
        })
    }

    /// An issuer on an existing [`etcd_client::Client`] (your own TLS, auth or timeouts).
    /// Setting [`ConnectOptions::with_require_leader`] on it is recommended: a member cut off
    /// from its leader then fails requests at once instead of holding them.
    #[must_use]
    pub fn new(client: Client) -> Self {
        Self {
            client,
            endpoints: Vec::new(),
            prefix: DEFAULT_KEY_PREFIX.into(),
            call_timeout: DEFAULT_CALL_TIMEOUT,
            grants: Arc::default(),
        }
    }

    /// The same issuer with another key prefix: lock keys become `PREFIX/lock/R`. Issuers
    /// with different prefixes share no lock (their tokens still come from the one revision
    /// counter of the cluster).
    ///
    /// # Errors
    /// [`InvalidInput::KeyPrefix`], as for [`RedisIssuer::with_key_prefix`](crate::RedisIssuer::with_key_prefix).
    pub fn with_key_prefix(mut self, prefix: &str) -> Result<Self> {
        self.prefix = check_key_prefix(prefix)?.into();
        Ok(self)
    }

    /// The key prefix (`pgfence` by default).
    #[must_use]
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// The same issuer with another call bound ([`DEFAULT_CALL_TIMEOUT`],
    /// 5 s, by default): an acquire, release, extend or status read returns within `bound`,
    /// its re-sends included, or fails with an [`Error::Backend`] timeout ([retryable](Error::is_retryable): the
    /// outcome is unknown). Each request also has the client's own 5 s timeout. The first
    /// attempt of a call gets at least 100 ms however small `bound` is. See
    /// `docs/issuers.md`, "Time bounds".
    #[must_use]
    pub fn with_call_timeout(mut self, bound: Duration) -> Self {
        self.call_timeout = bound;
        self
    }

    /// The call bound (see [`EtcdIssuer::with_call_timeout`]).
    #[must_use]
    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// This issuer's etcd key for `resource`'s lock: `PREFIX/lock/R`.
    #[must_use]
    pub fn lock_key(&self, resource: &Resource) -> String {
        prefixed_key(&self.prefix, resource)
    }

    /// The endpoints this issuer connected to (`http://host:port`, or `https://host:port` for
    /// `etcd+https://`; empty for [`EtcdIssuer::new`]).
    #[must_use]
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The underlying client.
    #[must_use]
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// One attempt: a read, and a lease grant and a transaction when the lock is free.
    async fn acquire_once(&self, ask: &Ask<'_>) -> Result<Attempt> {
        let secs = lease_secs(ask.ttl)?;
        let (resource, owner) = (ask.resource, ask.owner);
        let key = self.lock_key(resource);
        let key = key.as_str();
        let sent_at = Instant::now();
        // A read first: a held lock costs no lease grant (a Raft write) to refuse.
        let read = self.client.kv_client().get(key, None).await?;
        if let Some(held) = read.kvs().first().cloned() {
            return self.held(ask, key, secs, held, sent_at).await;
        }
        // The key would be created at a revision above the one just read: refuse at the
        // limit before anything is written.
        let revision = read
            .header()
            .map_or(0, etcd_client::ResponseHeader::revision);
        if revision >= MAX_TOKEN {
            return Err(limit_refused(resource, revision, false));
        }
        let lease_id = self.grant(ask.call, secs).await?;
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(key, owner, Some(PutOptions::new().with_lease(lease_id))),
                TxnOp::get(key, None),
            ])
            .or_else([TxnOp::get(key, None)]);
        // On an error the transaction may have applied: the lease is then the lock's, so it
        // is not revoked here; a retry (same owner) finds the lock, moves it to a lease of its
        // own and returns its token, and a call that returns no lease revokes the leases it
        // granted ([`EtcdIssuer::abandon`]).
        let reply = self.client.kv_client().txn(txn).await?;
        let kv = last_kv(&reply);
        if !reply.succeeded() {
            self.revoke(lease_id).await;
            return match kv {
                Some(held) => self.held(ask, key, secs, held, sent_at).await,
                None => Ok(Attempt::Again),
            };
        }
        let created = kv.map_or(0, |kv| kv.create_revision());
        if !(1..=MAX_TOKEN).contains(&created) {
            // Other writes passed the limit between the read and the transaction: leave
            // nothing behind, the lock is useless without a valid token.
            self.undo(key, created, lease_id).await;
            return Err(limit_refused(resource, created, true));
        }
        Ok(Attempt::Granted(
            ask.lease(FenceToken::new(created)?, sent_at),
        ))
    }

    /// The lock is held: by the asker (renew it, same token) or by someone else (retry_in).
    async fn held(
        &self,
        ask: &Ask<'_>,
        key: &str,
        secs: i64,
        held: KeyValue,
        sent_at: Instant,
    ) -> Result<Attempt> {
        let resource = ask.resource;
        let created = held.create_revision();
        if created > MAX_TOKEN {
            // A lock created past the limit (a refused acquire whose clean-up did not get
            // through) carries no token anyone can use: remove it, and refuse as that acquire
            // did, whoever asks.
            self.undo(key, created, held.lease()).await;
            return Err(limit_refused(resource, created, true));
        }
        if held.value() != ask.owner.as_bytes() {
            return Ok(Attempt::Busy(self.remaining(held.lease()).await?));
        }
        let mut lease = ask.lease(FenceToken::new(held.create_revision())?, sent_at);
        // The same owner again: renew for the TTL asked now, as Redis's PEXPIRE does.
        Ok(
            match self
                .renew(key, &mut lease, held, secs, false, sent_at, Some(ask.call))
                .await?
            {
                LeaseState::Held => Attempt::Granted(lease),
                _ => Attempt::Again,
            },
        )
    }

    /// Renews a lock `lease` holds (`held` is its key as just read): one keep-alive when the
    /// etcd lease already has this TTL (`keep`), else a move to a new etcd lease. `call`: the
    /// acquire call adopting the lock (the new lease is recorded as that call's, and the move
    /// happens only if the lock is still under the lease read), or `None` for an extend.
    #[allow(clippy::too_many_arguments)]
    async fn renew(
        &self,
        key: &str,
        lease: &mut Lease,
        held: KeyValue,
        secs: i64,
        keep: bool,
        sent_at: Instant,
        call: Option<u64>,
    ) -> Result<LeaseState> {
        let old = held.lease();
        if keep && old != 0 {
            match self.client.lease_client().keep_alive(old).await {
                // The stream is closed when the keeper and the stream drop.
                Ok(_) => {
                    lease.deadline = sent_at + lease.ttl;
                    return Ok(LeaseState::Held);
                }
                // The etcd lease ran out between the read and the keep-alive.
                Err(etcd_client::Error::LeaseKeepAliveError(_)) => {
                    return Ok(match self.get(key).await? {
                        None => LeaseState::Expired,
                        Some(kv) if holds(&kv, lease) => LeaseState::Expired,
                        Some(_) => LeaseState::Taken,
                    });
                }
                Err(e) => return Err(e.into()),
            }
        }
        let new = match call {
            Some(call) => self.grant(call, secs).await?,
            None => self.client.lease_client().grant(secs, None).await?.id(),
        };
        let mut owned = owned_by(key, lease).to_vec();
        if call.is_some() {
            // An acquire adopting the lock moves it only from the lease it found: the late
            // transaction of an earlier call (same owner) cannot take back a lock a later call
            // moved to a lease of its own, and the earlier call's clean-up then spares it.
            owned.push(Compare::lease(key, CompareOp::Equal, old));
        }
        let txn = Txn::new()
            .when(owned)
            .and_then([TxnOp::put(
                key,
                lease.owner.as_str(),
                Some(PutOptions::new().with_lease(new)),
            )])
            .or_else([TxnOp::get(key, None)]);
        let reply = match self.client.kv_client().txn(txn).await {
            Ok(reply) => reply,
            Err(e) => {
                // Unknown outcome: the new lease may now carry the lock; leave both to expire
                // (an acquire call that returns no lease revokes the new one).
                return Err(e.into());
            }
        };
        if reply.succeeded() {
            if old != 0 {
                self.revoke(old).await;
            }
            lease.deadline = sent_at + lease.ttl;
            Ok(LeaseState::Held)
        } else {
            self.revoke(new).await;
            Ok(if first_kv(&reply).is_some() {
                LeaseState::Taken
            } else {
                LeaseState::Expired
            })
        }
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        let reply = self.client.kv_client().get(key, None).await?;
        Ok(reply.kvs().first().cloned())
    }

    /// The remaining TTL of etcd lease `id` (zero when gone or unknown).
    async fn remaining(&self, id: i64) -> Result<Duration> {
        if id == 0 {
            // A lock key without a lease (written by hand): no expiry to wait for.
            return Ok(Duration::from_secs(1));
        }
        let left = self
            .client
            .lease_client()
            .time_to_live(id, None)
            .await?
            .ttl();
        Ok(Duration::from_secs(u64::try_from(left).unwrap_or(0)))
    }

    /// Deletes the lock `key` if it is still the one created at revision `created`, and revokes
    /// its etcd lease `lease_id` (best effort: a lease that is not revoked expires by itself,
    /// and the next acquire that finds the key removes it).
    async fn undo(&self, key: &str, created: i64, lease_id: i64) {
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, created)])
            .and_then([TxnOp::delete(key, None)]);
        if let Err(e) = self.client.kv_client().txn(txn).await {
            tracing::debug!(target: "pgfence::issuer", key, error = %e, "could not delete an etcd lock created past the token limit; its lease is revoked");
        }
        if lease_id != 0 {
            self.revoke(lease_id).await;
        }
    }

    /// Grants an etcd lease of `secs` seconds for the acquire call `call`, and records it as
    /// that call's until the call returns (see [`EtcdIssuer::abandon`]).
    async fn grant(&self, call: u64, secs: i64) -> Result<i64> {
        let granted = self.client.lease_client().grant(secs, None).await?;
        // The server may have raised the TTL to its minimum: the lease lives that long.
        let ttl = u64::try_from(granted.ttl().max(secs)).unwrap_or(0);
        self.grants.record(
            call,
            Grant {
                id: granted.id(),
                expires: Instant::now() + Duration::from_secs(ttl) + EXPIRY_SLACK,
            },
        );
        tracing::debug!(target: "pgfence::issuer", lease = granted.id(), "granted an etcd lease; taking the lock under it");
        Ok(granted.id())
    }

    /// The clean-up of an acquire call (`ask`) that returned no lease (an error, or busy)
    /// after an attempt whose outcome is unknown: that attempt's transaction, cut off or lost
    /// with its connection, may have taken the lock — or may still, delivered late — under an
    /// etcd lease the call granted, for an owner told the call failed. Revoking those leases
    /// deletes such a lock, and a transaction that arrives after the revoke fails (its lease
    /// is gone), so the order does not matter. Sent in the background, each revoke bounded by
    /// the call bound and re-sent after transport failures until the lease has expired by
    /// itself.
    ///
    /// It never removes a lease a later call handed out: a later call of the same owner that
    /// finds the lock (`acquire_wait`, or `acquire_as` re-sent) moves it to a new etcd lease of
    /// its own ([`EtcdIssuer::renew`]) before returning it, so the lock is then under no lease
    /// this call granted, and a late transaction of this call that would move it back finds
    /// it under another lease than it read and changes nothing. A call that returned a lease
    /// revokes none.
    fn abandon(&self, ask: &Ask<'_>) {
        let grants = self.grants.take(ask.call);
        if grants.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let key: Arc<str> = self.lock_key(ask.resource).into();
        for grant in grants {
            runtime.spawn(self.clone().revoke_abandoned(grant, key.clone()));
        }
    }

    /// Revokes `grant`, an etcd lease of a failed acquire of the lock `key`, re-sent after
    /// transport failures (harmless: revoking twice changes nothing) until it has expired.
    async fn revoke_abandoned(self, grant: Grant, key: Arc<str>) {
        let key = &*key;
        let mut pause = Duration::from_millis(50);
        loop {
            let left = grant.expires.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            let budget = self.call_timeout.max(Duration::from_millis(100)).min(left);
            let mut leases = self.client.lease_client();
            match tokio::time::timeout(budget, leases.revoke(grant.id)).await {
                Ok(Ok(_)) => {
                    tracing::debug!(target: "pgfence::issuer", key, lease = grant.id, "revoked the etcd lease of a failed acquire (and the lock, had its late transaction taken it)");
                    return;
                }
                Ok(Err(e)) if lease_not_found(&e) => {
                    tracing::debug!(target: "pgfence::issuer", key, lease = grant.id, "the etcd lease of a failed acquire is already gone");
                    return;
                }
                Ok(Err(e)) if !is_transient(&e) => {
                    tracing::warn!(target: "pgfence::issuer", key, lease = grant.id, error = %e, "could not revoke the etcd lease of a failed acquire; a lock its late transaction took lapses with its TTL");
                    return;
                }
                // A transport failure, or no answer within the bound.
                _ if Instant::now() + pause < grant.expires => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                _ => return,
            }
        }
    }

    /// Best-effort revoke: a lease that is not revoked expires by itself.
    async fn revoke(&self, id: i64) {
        if let Err(e) = self.client.lease_client().revoke(id).await {
            tracing::debug!(target: "pgfence::issuer", lease = id, error = %e, "etcd lease revoke failed; it will expire");
        }
    }
}

issuer_methods! {
    impl[] EtcdIssuer {
        error: "[`Error::Backend`](crate::Error::Backend)",
        acquire: {
            /// The TTL is rounded up to whole seconds on the server (see the type's docs, "TTLs").
        }
        acquire_as: {
            /// `retry_in` is the holder's remaining lease TTL as etcd reports it (whole seconds).
        }
        acquire_wait: {}
        release: {
            /// Its etcd lease is revoked too.
        }
        extend: {
            ///
            /// The TTL is rounded up to whole seconds on the server. With the TTL the lease was
            /// granted with ([`Lease::ttl`]) this is one keep-alive of the etcd lease; with
            /// another TTL the key moves to a new etcd lease of that TTL (its
            /// `create_revision`, the token, stays).
        }
        status: {
            /// `counter` is the cluster's current revision: every token issued so far is at most
            /// this, and the next one will be above it. `ttl_ms` has etcd's resolution, whole
            /// seconds.
        }
    }
}

/// Revisions never go backwards: nothing to raise, nothing to reseed (the defaults).
impl Backend for EtcdIssuer {
    const KIND: IssuerKind = IssuerKind::Etcd;
    const RESEND: Resend = PATIENT;

    fn key_prefix(&self) -> &str {
        &self.prefix
    }

    fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// Counts this prefix's lock keys (`PREFIX/lock/`, count only): each lives under an etcd
    /// lease and goes with it; there is no counter per resource (tokens are revisions).
    async fn state_once(&self) -> Result<Option<IssuerState>> {
        let prefix = format!("{}/lock/", self.prefix);
        let reply = self
            .client
            .kv_client()
            .get(
                prefix,
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_count_only(),
                ),
            )
            .await?;
        Ok(Some(IssuerState {
            counters: 0,
            expiring: Some(0),
            locks: u64::try_from(reply.count()).unwrap_or(0),
            idle: 0,
            other: 0,
            floors: 0,
            idle_expiry: None,
        }))
    }

    fn no_reply(after: Duration) -> Error {
        Error::etcd(etcd_client::Error::IoError(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no reply from etcd within {after:?}"),
        )))
    }

    async fn try_acquire(&self, ask: &Ask<'_>) -> Result<Attempt> {
        let attempt = self.acquire_once(ask).await;
        if let Ok(Attempt::Granted(_)) = &attempt {
            // The call returns this lease: none of its leases is revoked.
            self.grants.forget(ask.call);
        }
        attempt
    }

    /// Revokes, in the background, the etcd leases the failed call `ask` granted: see
    /// [`EtcdIssuer::abandon`].
    async fn acquire_abandoned(&self, ask: &Ask<'_>) {
        self.abandon(ask);
    }

    async fn release_once(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let key = self.lock_key(&lease.resource);
        let txn = Txn::new()
            .when(owned_by(&key, lease))
            .and_then([
                TxnOp::get(key.as_str(), None),
                TxnOp::delete(key.as_str(), None),
            ])
            .or_else([TxnOp::get(key.as_str(), None)]);
        let reply = self.client.kv_client().txn(txn).await?;
        let kv = first_kv(&reply);
        if reply.succeeded() {
            if let Some(kv) = kv.filter(|kv| kv.lease() != 0) {
                self.revoke(kv.lease()).await;
            }
            Ok(ReleaseOutcome::Released)
        } else if kv.is_some() {
            Ok(ReleaseOutcome::TakenByOther)
        } else {
            Ok(ReleaseOutcome::AlreadyExpired)
        }
    }

    async fn extend_once(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        let secs = lease_secs(ttl)?;
        let sent_at = Instant::now();
        let key = self.lock_key(&lease.resource);
        let Some(held) = self.get(&key).await? else {
            return Ok(Renewal::Expired);
        };
        if !holds(&held, lease) {
            return Ok(Renewal::Taken);
        }
        let same_ttl = lease_secs(lease.ttl).ok() == Some(secs);
        let mut renewed = lease.clone();
        renewed.ttl = ttl;
        let state = self
            .renew(&key, &mut renewed, held, secs, same_ttl, sent_at, None)
            .await?;
        Ok(Renewal::of(state, renewed.deadline))
    }

    async fn status_once(&self, resource: &Resource) -> Result<LockStatus> {
        let key = self.lock_key(resource);
        let reply = self.client.kv_client().get(key.as_str(), None).await?;
        let counter = reply
            .header()
            .map_or(0, etcd_client::ResponseHeader::revision);
        let held = reply.kvs().first().cloned();
        let (owner, token, ttl_ms) = match held {
            Some(kv) => {
                let ttl_ms = if kv.lease() == 0 {
                    None
                } else {
                    let left = self
                        .client
                        .lease_client()
                        .time_to_live(kv.lease(), None)
                        .await?
                        .ttl();
                    Some(left.max(0).saturating_mul(1000))
                };
                (
                    Some(String::from_utf8_lossy(kv.value()).into_owned()),
                    Some(kv.create_revision()),
                    ttl_ms,
                )
            }
            None => (None, None, None),
        };
        Ok(LockStatus {
            resource: resource.to_string(),
            owner,
            token,
            ttl_ms,
            counter,
        })
    }
}

/// How long past its TTL an etcd lease may still be there: etcd expires leases lazily (about
/// twice a second) and renews them all when a new leader is elected.
const EXPIRY_SLACK: Duration = Duration::from_secs(1);

/// An etcd lease an acquire call granted, and when it will have expired by itself.
#[derive(Clone, Copy, Debug)]
struct Grant {
    id: i64,
    expires: Instant,
}

/// The etcd leases granted by each acquire call in flight, by call id ([`Ask::call`]): kept
/// until the call returns a lease (forgotten), its clean-up takes them
/// ([`EtcdIssuer::abandon`]), or they have expired by themselves (pruned).
#[derive(Debug, Default)]
struct Grants(Mutex<HashMap<u64, Vec<Grant>>>);

impl Grants {
    fn calls(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Vec<Grant>>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn record(&self, call: u64, grant: Grant) {
        let mut calls = self.calls();
        let now = Instant::now();
        calls.retain(|_, grants| grants.iter().any(|g| g.expires > now));
        calls.entry(call).or_default().push(grant);
    }

    fn forget(&self, call: u64) {
        self.calls().remove(&call);
    }

    fn take(&self, call: u64) -> Vec<Grant> {
        self.calls().remove(&call).unwrap_or_default()
    }
}

/// Whether `e` is etcd's "requested lease not found" (revoked, or expired).
fn lease_not_found(e: &etcd_client::Error) -> bool {
    // gRPC code NotFound (5).
    matches!(e, etcd_client::Error::GRpcStatus(status) if i32::from(status.code()) == 5)
}

/// The refusal at the token limit: the cluster's revision is at `revision`.
fn limit_refused(resource: &Resource, revision: i64, undone: bool) -> Error {
    policy::limit_refused(
        resource,
        &format!("the etcd cluster's revision, its token counter (at {revision}),"),
        "etcd revisions never go backwards, so this cluster can issue no more tokens",
        undone,
    )
}

/// The compare that proves `lease` holds its lock: the key's value is its owner and the key
/// was created with its token.
fn owned_by(key: &str, lease: &Lease) -> [Compare; 2] {
    [
        Compare::value(key, CompareOp::Equal, lease.owner.as_str()),
        Compare::create_revision(key, CompareOp::Equal, lease.token.get()),
    ]
}

fn holds(kv: &KeyValue, lease: &Lease) -> bool {
    kv.value() == lease.owner.as_bytes() && kv.create_revision() == lease.token.get()
}

/// The key read by the transaction's first `Get` (release puts it first).
fn first_kv(reply: &TxnResponse) -> Option<KeyValue> {
    reply.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(get) => get.kvs().first().cloned(),
        _ => None,
    })
}

/// The key read by the transaction's last `Get` (acquire puts it after the `Put`).
fn last_kv(reply: &TxnResponse) -> Option<KeyValue> {
    reply
        .op_responses()
        .into_iter()
        .rev()
        .find_map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().cloned(),
            _ => None,
        })
}

/// A TTL as whole etcd seconds, rounded up (at least 1).
fn lease_secs(ttl: Duration) -> Result<i64> {
    let millis = check_ttl(ttl)?.as_millis();
    i64::try_from(millis.div_ceil(1000).max(1))
        .map_err(|_| Error::Invalid(InvalidInput::Duration(format!("{ttl:?}"))))
}

type Credentials = Option<(String, String)>;

/// A parsed etcd issuer URL.
#[derive(Debug)]
struct EtcdUrl {
    user: Credentials,
    /// `http://host:port` (`https://` over TLS).
    endpoints: Vec<String>,
    /// The TLS parameters of an `etcd+https://` URL (`None`: plaintext).
    tls: Option<TlsParams>,
}

/// `etcd://[user:password@]host[:port][,host[:port]...][/]`, or `etcd+https://...` with the
/// TLS parameters `cacert`, `cert` and `key` → credentials, endpoints and TLS parameters.
fn parse_url(url: &str) -> Result<EtcdUrl> {
    let invalid = |why: &str| {
        Error::Invalid(InvalidInput::IssuerUrl(format!(
            "etcd URL: {why} (expected etcd://host:port[,host:port...] or etcd+https://host:port[,host:port...][?cacert=PATH&cert=PATH&key=PATH])"
        )))
    };
    let (scheme_len, tls) = if has_scheme(url, SCHEME) {
        (SCHEME.len(), false)
    } else if has_scheme(url, TLS_SCHEME) {
        (TLS_SCHEME.len(), true)
    } else {
        return Err(invalid("not an etcd:// or etcd+https:// URL"));
    };
    let (url, params) = TlsParams::split(url)?;
    if !tls {
        params.refuse_on_plain("etcd://", "etcd+https://")?;
    }
    let rest = &url[scheme_len..];
    if rest.contains('?') {
        return Err(invalid(
            "unknown query parameter (only cacert, cert and key, with etcd+https://)",
        ));
    }
    let rest = rest.trim_end_matches('/');
    let (user, hosts) = match rest.rsplit_once('@') {
        Some((user, hosts)) => {
            let (name, password) = user.split_once(':').unwrap_or((user, ""));
            (Some((name.to_owned(), password.to_owned())), hosts)
        }
        None => (None, rest),
    };
    let endpoints = host_list(hosts, DEFAULT_PORT)
        .map_err(invalid)?
        .into_iter()
        .map(|h| format!("{}://{h}", if tls { "https" } else { "http" }))
        .collect();
    Ok(EtcdUrl {
        user,
        endpoints,
        tls: tls.then_some(params),
    })
}

/// `options` with TLS from `params`: their CA only, or the system trust store, and their
/// client certificate when given.
#[cfg(feature = "tls")]
fn with_tls(options: ConnectOptions, params: &TlsParams) -> Result<ConnectOptions> {
    use etcd_client::{Certificate, Identity, TlsOptions};
    crate::tls::ensure_crypto_provider();
    let files = params.read()?;
    let mut tls = TlsOptions::new().timeout(CONNECT_TIMEOUT);
    tls = match files.ca {
        Some(ca) => tls.ca_certificate(Certificate::from_pem(ca)),
        None => tls.with_native_roots(),
    };
    if let Some((cert, key)) = files.identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    Ok(options.with_tls(tls))
}

/// Without the `tls` feature: [`Error::IssuerNotBuilt`].
#[cfg(not(feature = "tls"))]
fn with_tls(_options: ConnectOptions, _params: &TlsParams) -> Result<ConnectOptions> {
    Err(crate::tls::not_built(TLS_SCHEME))
}

/// Whether an etcd error is transient: the connection, a missing or changing leader, a
/// timeout. A lease or transaction that failed for a reason of its own is not.
pub(crate) fn is_transient(e: &etcd_client::Error) -> bool {
    if tls_rejected(e) {
        // A certificate refused by either side: retrying the handshake changes nothing.
        return false;
    }
    match e {
        etcd_client::Error::IoError(_) | etcd_client::Error::TransportError(_) => true,
        // gRPC codes: Cancelled 1, Unknown 2 (broken HTTP/2 streams), DeadlineExceeded 4,
        // Aborted 10, Unavailable 14 (no leader, leader changed, request timed out).
        etcd_client::Error::GRpcStatus(status) => {
            matches!(i32::from(status.code()), 1 | 2 | 4 | 10 | 14)
        }
        _ => false,
    }
}

/// Whether `e` comes from a failed TLS handshake (a certificate refused by either side).
fn tls_rejected(e: &etcd_client::Error) -> bool {
    #[cfg(feature = "tls")]
    {
        match e {
            etcd_client::Error::GRpcStatus(status) => crate::tls::tls_rejection(status).is_some(),
            etcd_client::Error::TransportError(t) => crate::tls::tls_rejection(t).is_some(),
            _ => false,
        }
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = e;
        false
    }
}

impl From<etcd_client::Error> for Error {
    fn from(e: etcd_client::Error) -> Self {
        Error::etcd(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_etcd_urls() {
        let u = parse_url("etcd://127.0.0.1:2379,10.0.0.2,[::1]:3000/").unwrap();
        assert!(u.user.is_none() && u.tls.is_none());
        assert_eq!(
            u.endpoints,
            [
                "http://127.0.0.1:2379",
                "http://10.0.0.2:2379",
                "http://[::1]:3000"
            ]
        );
        let u = parse_url("ETCD://root:s3cret@h1:1,h2:2").unwrap();
        assert_eq!(u.user, Some(("root".into(), "s3cret".into())));
        assert_eq!(u.endpoints, ["http://h1:1", "http://h2:2"]);
        assert_eq!(
            parse_url("etcd://[::1]").unwrap().endpoints,
            ["http://[::1]:2379"]
        );
        for bad in [
            "redis://h",
            "etcd://",
            "etcd://h:x",
            "etcd://a,,b",
            "etcd://h/p",
            "etcd://h?x=1",
            "etcd+https://h?x=1",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
        for (url, etcd) in [
            ("etcd://h", true),
            ("ETCD+HTTPS://h", true),
            ("redis://h", false),
        ] {
            assert_eq!(
                IssuerKind::of_url(url).unwrap() == IssuerKind::Etcd,
                etcd,
                "{url}"
            );
        }
        assert!(IssuerKind::of_url("etc").is_err());
    }

    #[test]
    fn parses_etcd_tls_urls() {
        let u = parse_url("etcd+https://h1:1,h2/?cacert=/ca%20dir/ca.pem&cert=/c.pem&key=/k.pem")
            .unwrap();
        assert_eq!(u.endpoints, ["https://h1:1", "https://h2:2379"]);
        let tls = u.tls.unwrap();
        assert_eq!(
            tls.cacert.as_deref(),
            Some(std::path::Path::new("/ca dir/ca.pem"))
        );
        assert!(tls.cert.is_some() && tls.key.is_some());
        let u = parse_url("etcd+https://h").unwrap();
        assert!(u.tls.is_some_and(|t| t.is_empty()));

        let err = parse_url("etcd://h?cacert=/ca.pem").unwrap_err();
        assert!(matches!(err, Error::Invalid(InvalidInput::Tls(_))), "{err}");
        assert!(err.to_string().contains("use etcd+https://"), "{err}");
        let err = parse_url("etcd+https://h?cert=/c.pem").unwrap_err();
        assert!(matches!(err, Error::Invalid(InvalidInput::Tls(_))), "{err}");
    }

    #[test]
    fn ttls_round_up_to_whole_seconds() {
        assert_eq!(lease_secs(Duration::from_millis(10)).unwrap(), 1);
        assert_eq!(lease_secs(Duration::from_millis(1000)).unwrap(), 1);
        assert_eq!(lease_secs(Duration::from_millis(1001)).unwrap(), 2);
        assert!(lease_secs(Duration::ZERO).is_err());
    }

    #[tokio::test]
    async fn grants_are_kept_per_call_until_returned_taken_or_expired() {
        let grants = Grants::default();
        let now = Instant::now();
        let live = |id| Grant {
            id,
            expires: now + Duration::from_secs(30),
        };
        grants.record(1, live(10));
        grants.record(1, live(11));
        grants.record(2, live(20));
        grants.record(
            3,
            Grant {
                id: 30,
                expires: now,
            },
        );
        // The next record prunes the call whose leases have all expired.
        grants.record(4, live(40));
        assert!(grants.take(3).is_empty());
        let ids = |v: Vec<Grant>| v.into_iter().map(|g| g.id).collect::<Vec<_>>();
        assert_eq!(ids(grants.take(1)), [10, 11]);
        assert!(grants.take(1).is_empty(), "taken once");
        grants.forget(2);
        assert!(grants.take(2).is_empty());
        assert_eq!(ids(grants.take(4)), [40]);
    }

    #[test]
    fn keys_keep_the_resource_name() {
        let r = Resource::in_domain("billing", "account:2").unwrap();
        assert_eq!(lock_key(&r), "pgfence/lock/{billing}account:2");
    }
}
