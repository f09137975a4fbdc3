//! The leases this issuer holds: the state its clones share, each lease's timer (ZooKeeper
//! has no expiry for ephemeral nodes), and the cleanup of nodes a lost reply left behind.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use zookeeper_client::Client;

use super::ZkIssuer;
use super::names::{is_owners, owner_stem};
use super::session::{delete, ended, list};
use crate::issuer::policy::resend;

pub(super) struct Inner {
    /// `host:port,...` as the client takes it.
    pub(super) hosts: String,
    pub(super) session_timeout: Duration,
    pub(super) client: Mutex<Client>,
    /// Serialises replacing an expired session.
    pub(super) reconnecting: tokio::sync::Mutex<()>,
    /// (lock dir, owner id) of acquires that failed after a create whose reply was lost: a
    /// node of theirs may exist, holding the lock with no timer. A cleanup task deletes such
    /// nodes unless an acquire of the same owner (an idempotent retry) takes the key first;
    /// the mutex makes the two exclusive.
    pub(super) strays: tokio::sync::Mutex<HashSet<(String, String)>>,
    /// The leases this issuer holds, by (lock dir, owner id).
    pub(super) held: Mutex<HashMap<(String, String), Arc<Held>>>,
}

impl Inner {
    /// The current session's client.
    pub(super) fn current(&self) -> Client {
        self.client
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Drops `held` from the map if it is still the entry for `key` (a newer lease of the same
    /// owner may have replaced it).
    pub(super) fn forget(&self, key: &(String, String), held: &Arc<Held>) {
        let mut map = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if map.get(key).is_some_and(|h| Arc::ptr_eq(h, held)) {
            map.remove(key);
        }
    }
}

/// A lock this issuer holds, and its timer's state.
pub(super) struct Held {
    pub(super) path: String,
    pub(super) token: i64,
    pub(super) state: Mutex<HeldState>,
    /// Wakes the timer when the deadline moves or the lease ends.
    pub(super) wake: Notify,
}

pub(super) struct HeldState {
    pub(super) deadline: Instant,
    pub(super) ended: bool,
}

impl Held {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HeldState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the deadline if the lease has not ended (false when it has).
    pub(super) fn renew(&self, deadline: Instant) -> bool {
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
    pub(super) fn end(&self) -> bool {
        let mut state = self.lock();
        let was = !state.ended;
        state.ended = true;
        drop(state);
        self.wake.notify_one();
        was
    }
}

/// Deletes the lock nodes `key`'s owner may have left in `key`'s dir after a failed acquire
/// (see `Inner::strays`), retrying for up to twice the session timeout (by then the session has
/// ended, and the ensemble has deleted them, or the connection is back). Stops when an acquire
/// of the same owner took the key over, or the issuer is gone.
pub(super) async fn remove_strays(inner: Weak<Inner>, key: (String, String)) {
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
pub(super) async fn expire(inner: Weak<Inner>, key: (String, String), held: Arc<Held>) {
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
        let (outcome, _) =
            resend::<ZkIssuer, _, _, _>(until, u32::MAX, || delete(&client, &held.path)).await;
        if let Err(e) = outcome {
            tracing::warn!(target: "pgfence::issuer", node = %held.path, error = %e, "could not delete an expired ZooKeeper lock node; it ends with the session");
        }
        return;
    }
}
