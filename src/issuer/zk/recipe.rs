//! The lock recipe, one attempt of each call: an ephemeral sequential node per try, the lowest
//! holding the lock, its creation zxid the token; release and extend find the lease's node.

use crate::error::InvalidInput;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use zookeeper_client::Client;

use super::ZkIssuer;
use super::held::{Held, HeldState, expire};
use super::names::{is_owners, owner_stem, queue};
use super::session::{create_lock_node, delete, is_no_node, list, timed};
use crate::issuer::IssuerState;
use crate::issuer::policy::{self, Ask, Attempt, Backend, PATIENT, Renewal, Resend, resend};
use crate::issuer::token_issuer::IssuerKind;
use crate::{
    Error, FenceToken, Lease, Resource, Result,
    issuer::{LockStatus, ReleaseOutcome},
    token::MAX_TOKEN,
};

/// Zxids never go backwards: nothing to raise, nothing to reseed (the defaults).
impl Backend for ZkIssuer {
    const KIND: IssuerKind = IssuerKind::ZooKeeper;
    const RESEND: Resend = PATIENT;

    fn key_prefix(&self) -> &str {
        &self.prefix
    }

    fn call_timeout(&self) -> Duration {
        self.call_timeout()
    }

    fn no_reply(_after: Duration) -> Error {
        Error::zookeeper(zookeeper_client::Error::Timeout)
    }

    /// Lists `/PREFIX/lock` (one container node per resource, which ZooKeeper deletes once
    /// its last lock node is gone) and each directory's lock nodes, 64 at a time; there is no
    /// counter per resource (tokens are zxids).
    async fn state_once(&self) -> Result<Option<IssuerState>> {
        use futures_util::StreamExt;
        let client = self.inner.current();
        let root = format!("/{}/lock", super::names::node_name(&self.prefix));
        let (dirs, _) = list(&client, &root).await?;
        let paths: Vec<String> = dirs.iter().map(|dir| format!("{root}/{dir}")).collect();
        let mut sizes = futures_util::stream::iter(paths)
            .map(move |path| {
                let client = client.clone();
                async move { list(&client, &path).await.map(|(nodes, _)| nodes.len()) }
            })
            .buffer_unordered(64);
        let (mut locks, mut empty) = (0u64, 0u64);
        while let Some(n) = sizes.next().await {
            match n? {
                0 => empty += 1,
                n => locks += n as u64,
            }
        }
        Ok(Some(IssuerState {
            counters: 0,
            expiring: Some(0),
            locks,
            idle: empty,
            other: dirs.len() as u64,
            floors: 0,
            idle_expiry: None,
        }))
    }

    /// One attempt: a listing, and a node created when the lock is free. The owner id in the
    /// node's name lets a re-sent attempt find a node an unanswered one created.
    async fn try_acquire(&self, ask: &Ask<'_>) -> Result<Attempt> {
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

    /// A create or a delete whose reply was lost may have left the owner's node, holding the
    /// lock with no timer until the session ends: removed in the background.
    async fn abandoned(&self, resource: &Resource, owner: &str) {
        self.sweep(&self.lock_dir(resource), owner).await;
    }

    /// One release. When this issuer took the lease, its node's path is unique (sequence
    /// numbers are never reused), so deleting it is owner-safe in one round trip.
    async fn release_once(&self, lease: &Lease) -> Result<ReleaseOutcome> {
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
                Err(e) if is_no_node(&e) => {}
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

    /// One extend: the node's existence is read on the ensemble, the deadline is the timer's.
    async fn extend_once(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
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
            _ => Err(Error::Invalid(InvalidInput::Owner(format!(
                "the ZooKeeper lock of {} (token {}) belongs to another session; only the issuer that acquired it can extend it",
                lease.resource, lease.token
            )))),
        }
    }

    /// One read of the lock dir, and of its first node.
    async fn status_once(&self, resource: &Resource) -> Result<LockStatus> {
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
                Err(e) if is_no_node(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(status)
    }
}

impl ZkIssuer {
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
