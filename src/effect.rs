//! [`Effects`], the fenced effect ledger: side effects outside PostgreSQL (a payment
//! provider's charge, an e-mail, a webhook) recorded under a lease before they are made, with
//! an idempotency key that is the same for every holder of the work item.
//!
//! Fencing protects what PostgreSQL stores; a third-party API cannot check a token. What it
//! can do is honour an idempotency key: the same key twice, and the provider does the work
//! once. The key must be the same for the zombie and for the new holder — a key derived from
//! the fence token is not, and the provider charges twice. [`Effects::begin`] draws the key
//! once per (scope, work key, step), stores it in `pgfence.effect` with the lease's fence,
//! and hands the same key to every later holder, together with the outcome a previous holder
//! recorded, so a new holder does not call again when the call is known to be done.

use crate::error::InvalidInput;
use sqlx::postgres::PgRow;
use sqlx::{PgExecutor, PgPool, Row};

use crate::audit::{AuditRow, Auditor, Rejection, RejectionKind};
use crate::repository::executor::Lent;
use crate::timeline::Verdict;
use crate::{Error, Fencing, Resource, Result, WriteExecutor, error::StaleTarget};

/// The table the ledger lives in, as named in errors and audit rows.
pub const EFFECT_TABLE: &str = "\"pgfence\".\"effect\"";

/// The longest work key accepted, in bytes.
pub const MAX_WORK_KEY_LEN: usize = 200;

/// The longest step name accepted, in bytes.
pub const MAX_STEP_LEN: usize = 100;

/// What a holder recorded after an effect's call ([`Effects::finish`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EffectOutcome {
    /// The call did what it was for (the charge was made): do not call again.
    Succeeded(serde_json::Value),
    /// The call definitely did not take effect (a declined card, a 4xx answer that is final).
    /// A new holder decides whether to try again, with the same key or after reconciling.
    Failed(serde_json::Value),
}

impl EffectOutcome {
    /// The recorded detail (the provider's answer, a charge id...).
    #[must_use]
    pub fn detail(&self) -> &serde_json::Value {
        match self {
            EffectOutcome::Succeeded(v) | EffectOutcome::Failed(v) => v,
        }
    }

    /// `succeeded` or `failed`.
    #[must_use]
    pub fn state(&self) -> &'static str {
        match self {
            EffectOutcome::Succeeded(_) => "succeeded",
            EffectOutcome::Failed(_) => "failed",
        }
    }
}

/// An effect recorded under a lease ([`Effects::begin`]): the idempotency key to send with
/// the call, and what a previous holder recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Effect {
    resource: Resource,
    work_key: String,
    step: String,
    key: String,
    recorded: Option<EffectOutcome>,
    holders: i32,
}

impl Effect {
    /// The idempotency key to send with the call (`Idempotency-Key: ...`): drawn at random
    /// when the first lease recorded this effect and the same for every holder since. Never
    /// derived from a token.
    #[must_use]
    pub fn idempotency_key(&self) -> &str {
        &self.key
    }

    /// The outcome a holder already recorded, if any. `Some(Succeeded)`: the call is known to
    /// be done, do not make it again. `None`: make the call with [`Effect::idempotency_key`]
    /// (a previous holder may have made it without recording: the key makes a second call
    /// harmless at a provider that honours it).
    #[must_use]
    pub fn recorded(&self) -> Option<&EffectOutcome> {
        self.recorded.as_ref()
    }

    /// Whether a holder recorded that the call succeeded.
    #[must_use]
    pub fn is_done(&self) -> bool {
        matches!(self.recorded, Some(EffectOutcome::Succeeded(_)))
    }

    /// How many leases have recorded this effect (1 for the first; more after takeovers).
    #[must_use]
    pub fn holders(&self) -> i32 {
        self.holders
    }

    /// The work item's key (e.g. `invoice:42`).
    #[must_use]
    pub fn work_key(&self) -> &str {
        &self.work_key
    }

    /// The step (e.g. `charge`).
    #[must_use]
    pub fn step(&self) -> &str {
        &self.step
    }

    /// The resource of the lease that recorded it.
    #[must_use]
    pub fn resource(&self) -> &Resource {
        &self.resource
    }
}

/// An effect as stored, read without a lease ([`Effects::status`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct EffectRecord {
    /// The idempotency key.
    pub idempotency_key: String,
    /// `pending`, `succeeded` or `failed`.
    pub state: String,
    /// The recorded outcome's detail, if any.
    pub outcome: Option<serde_json::Value>,
    /// How many leases recorded it.
    pub holders: i32,
    /// The token of the lease that last recorded or finished it.
    pub token: i64,
    /// That lease's holder (owner id).
    pub holder: Option<String>,
}

/// The effect ledger: records side effects under a lease and audits refusals, like
/// [`Fence`](crate::Fence) does for checks.
///
/// The unit is (scope, work key, step): the scope is the lease's token counter — its
/// resource, or its fencing domain — so every holder of the work item meets the same row.
///
/// # The job
///
/// ```no_run
/// # async fn charge(key: &str) -> serde_json::Value { serde_json::json!({}) }
/// # async fn f(pool: sqlx::PgPool, lease: pgfence::Lease) -> pgfence::Result<()> {
/// use pgfence::{Effects, effect::EffectOutcome};
/// let effects = Effects::new(pool.clone());
/// // 1. Record the effect before calling: committed at once (on the pool), so a holder that
/// //    takes over sees its key. A lease that is already fenced out stops here (StaleToken).
/// let effect = effects.begin(&pool, &lease, "invoice:42", "charge").await?;
/// if !effect.is_done() {
///     // 2. Call the provider with the key: a zombie that paused between 1 and 2 sends the
///     //    same key as the new holder, so the provider charges once.
///     let answer = charge(effect.idempotency_key()).await;
///     // 3. Record the outcome with the job's own writes, in one transaction.
///     let mut tx = pool.begin().await?;
///     effects
///         .finish(&mut *tx, &lease, &effect, EffectOutcome::Succeeded(answer))
///         .await?;
///     // ... repo.update(&mut *tx, &lease, &paid_invoice).await? ...
///     tx.commit().await?;
/// }
/// # Ok(()) }
/// ```
///
/// `begin`'s row must be committed **before** the call: in a transaction, commit it first
/// (otherwise a holder that takes over cannot see the key, draws its own, and the provider
/// sees two keys). `finish` belongs in the transaction that records the job's result.
///
/// "Fenced out" means: a newer lease recorded this effect, or checked the lease's resource
/// ([`Fence::check`](crate::Fence::check)). A newer lease that only claimed the work item's
/// row is not seen here; to be refused by that too, claim the row
/// ([`Repository::claim`](crate::Repository::claim)) and `begin` in one transaction, and
/// commit it before the call: the claim rejects the zombie.
#[derive(Clone, Debug)]
pub struct Effects {
    handle: crate::repository::executor::Handle,
}

impl Effects {
    /// A ledger handle that audits refusals through `pool`.
    #[must_use]
    pub fn new(pool: PgPool) -> Self {
        Self::with_auditor(Auditor::new(pool))
    }

    /// A ledger handle with a custom [`Auditor`].
    #[must_use]
    pub fn with_auditor(auditor: Auditor) -> Self {
        Self {
            handle: crate::repository::executor::Handle::new(auditor),
        }
    }

    /// Bounds every [`Effects::begin`] and [`Effects::finish`] by `bound` instead of 30 s
    /// ([`DEFAULT_CALL_TIMEOUT`](crate::repository::DEFAULT_CALL_TIMEOUT)), with the same
    /// server-side gate as [`Repository::with_call_timeout`](crate::Repository::with_call_timeout):
    /// [`Error::TimedOut`] when the call is not done by then.
    ///
    /// # Errors
    /// [`InvalidInput::Duration`] when `bound` is under 10 ms or over a day.
    pub fn with_call_timeout(mut self, bound: std::time::Duration) -> Result<Self> {
        self.handle = self.handle.with_call_timeout(bound)?;
        Ok(self)
    }

    /// Records the effect `step` of work item `work_key` under the lease, before its call, and
    /// returns its idempotency key and what a previous holder recorded. The same lease may
    /// call it again (same key); a newer lease takes the effect over (same key, and older
    /// leases are refused from then on).
    ///
    /// # Errors
    /// [`Error::StaleToken`] (logged and audited, operation `effect`) when a newer lease
    /// recorded this effect or checked the resource: do not make the call;
    /// [`Error::DuplicateToken`], [`Error::RowSealed`] as for row writes;
    /// [`InvalidInput::Effect`] for an empty or too long work key or step, or a `fencing`
    /// without its resource (pass the [`Lease`](crate::Lease)); [`Error::Backend`].
    pub async fn begin<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        work_key: &str,
        step: &str,
    ) -> Result<Effect> {
        let fencing = fencing.into();
        let resource = effect_resource(&fencing, work_key, step)?;
        let fencing = &fencing;
        // The write's connection goes back before a refusal's audit row takes one.
        let row = crate::repository::executor::bounded(
            self.handle.call_timeout,
            "effect",
            || EFFECT_TABLE.to_owned(),
            exec.into_target(),
            |mut lent| async move {
                let result = async {
                    // The timeline first: a lease fenced out by a failover records nothing.
                    self.on_timeline(&mut lent, fencing, resource, "effect")
                        .await?;
                    let row: PgRow = sqlx::query(
                        "SELECT status, idempotency_key, state, outcome::text AS outcome, holders, current, \
                         other_counter FROM pgfence.effect_begin($1, $2, $3, $4, $5, $6)",
                    )
                    .bind(resource.as_str())
                    .bind(work_key)
                    .bind(step)
                    .bind(fencing.token.get())
                    .bind(i32::from(fencing.tag()))
                    .bind(fencing.holder.as_deref())
                    .fetch_one(lent.conn())
                    .await?;
                    Ok(row)
                }
                .await;
                (lent, result)
            },
        )
        .await?;
        let status: String = row.try_get("status")?;
        if status != "ok" {
            return Err(self
                .refused(&row, &status, fencing, resource, work_key, step, "effect")
                .await);
        }
        let state: String = row.try_get("state")?;
        let outcome = json_column(&row, "outcome")?;
        let recorded = match state.as_str() {
            "succeeded" => Some(EffectOutcome::Succeeded(
                outcome.unwrap_or(serde_json::Value::Null),
            )),
            "failed" => Some(EffectOutcome::Failed(
                outcome.unwrap_or(serde_json::Value::Null),
            )),
            _ => None,
        };
        Ok(Effect {
            resource: resource.clone(),
            work_key: work_key.to_owned(),
            step: step.to_owned(),
            key: row.try_get("idempotency_key")?,
            recorded,
            holders: row.try_get("holders")?,
        })
    }

    /// Records `effect`'s outcome under the lease, after its call: fenced like
    /// [`Effects::begin`], so an older lease cannot overwrite a newer holder's outcome. Put it
    /// in the transaction that records the job's own result.
    ///
    /// # Errors
    /// [`Error::StaleToken`] (logged and audited, operation `effect_finish`) when a newer
    /// lease recorded or finished the effect, or checked the resource;
    /// [`Error::NotFound`] when no lease began it (nothing is written);
    /// [`Error::DuplicateToken`], [`Error::RowSealed`], [`InvalidInput::Effect`],
    /// [`Error::Backend`] as for [`Effects::begin`].
    pub async fn finish<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        effect: &Effect,
        outcome: EffectOutcome,
    ) -> Result<()> {
        self.finish_step(exec, fencing, &effect.work_key, &effect.step, outcome)
            .await
    }

    /// [`Effects::finish`] by work key and step (for a job that did not keep the
    /// [`Effect`], e.g. across processes).
    ///
    /// # Errors
    /// As [`Effects::finish`].
    pub async fn finish_step<'c, E: WriteExecutor<'c>>(
        &self,
        exec: E,
        fencing: impl Into<Fencing>,
        work_key: &str,
        step: &str,
        outcome: EffectOutcome,
    ) -> Result<()> {
        let fencing = fencing.into();
        let resource = effect_resource(&fencing, work_key, step)?;
        let succeeded = matches!(outcome, EffectOutcome::Succeeded(_));
        let fencing = &fencing;
        // The write's connection goes back before a refusal's audit row takes one.
        let row = crate::repository::executor::bounded(
            self.handle.call_timeout,
            "effect_finish",
            || EFFECT_TABLE.to_owned(),
            exec.into_target(),
            |mut lent| async move {
                let result = async {
                    self.on_timeline(&mut lent, fencing, resource, "effect_finish")
                        .await?;
                    let row: PgRow = sqlx::query(
                        "SELECT status, current, other_counter \
                         FROM pgfence.effect_finish($1, $2, $3, $4, $5, $6, $7, ($8::text)::jsonb)",
                    )
                    .bind(resource.as_str())
                    .bind(work_key)
                    .bind(step)
                    .bind(fencing.token.get())
                    .bind(i32::from(fencing.tag()))
                    .bind(fencing.holder.as_deref())
                    .bind(succeeded)
                    .bind(outcome.detail().to_string())
                    .fetch_one(lent.conn())
                    .await?;
                    Ok(row)
                }
                .await;
                (lent, result)
            },
        )
        .await?;
        let status: String = row.try_get("status")?;
        match status.as_str() {
            "ok" => Ok(()),
            "missing" => Err(Error::NotFound {
                table: EFFECT_TABLE.to_owned(),
                key: effect_key_json(work_key, step),
            }),
            _ => Err(self
                .refused(
                    &row,
                    &status,
                    fencing,
                    resource,
                    work_key,
                    step,
                    "effect_finish",
                )
                .await),
        }
    }

    /// The effect as stored (no lease needed; `None` when no lease recorded it): for status
    /// displays and reconciliation.
    ///
    /// # Errors
    /// [`InvalidInput::Effect`]; [`Error::Backend`].
    pub async fn status<'c, E: PgExecutor<'c>>(
        &self,
        exec: E,
        resource: &Resource,
        work_key: &str,
        step: &str,
    ) -> Result<Option<EffectRecord>> {
        check_names(work_key, step)?;
        let row = sqlx::query(
            "SELECT idempotency_key, state, outcome::text AS outcome, holders, token, holder \
             FROM pgfence.effect_status($1, $2, $3)",
        )
        .bind(resource.as_str())
        .bind(work_key)
        .bind(step)
        .fetch_optional(exec)
        .await?;
        row.map(|row| {
            Ok(EffectRecord {
                idempotency_key: row.try_get("idempotency_key")?,
                state: row.try_get("state")?,
                outcome: json_column(&row, "outcome")?,
                holders: row.try_get("holders")?,
                token: row.try_get("token")?,
                holder: row.try_get("holder")?,
            })
        })
        .transpose()
    }

    /// Refuses a lease that wrote before the database failed over
    /// ([`Error::FencedByFailover`], logged and audited), on the connection the ledger
    /// statement then runs on: a connection stays on one server, and a server's timeline only
    /// changes by a promotion, which a primary never goes through again.
    async fn on_timeline(
        &self,
        lent: &mut Lent<'_>,
        fencing: &Fencing,
        resource: &Resource,
        operation: &'static str,
    ) -> Result<()> {
        loop {
            self.handle
                .seen
                .bind(&fencing.timeline, lent.conn())
                .await?;
            let now: i64 = sqlx::query_scalar("SELECT pgfence.timeline()")
                .fetch_one(lent.conn())
                .await
                .map_err(|e| {
                    let e = Error::from(e);
                    self.handle.seen.forget_on(&e);
                    e
                })?;
            let (lease_timeline, timeline) = match self.handle.seen.verdict(&fencing.timeline, now)
            {
                Verdict::Fine => return Ok(()),
                Verdict::Again => continue,
                Verdict::Refused {
                    lease_timeline,
                    timeline,
                } => (lease_timeline, timeline),
            };
            let rejection = Rejection {
                resource: Some(resource.to_string()),
                table: Some(EFFECT_TABLE.to_owned()),
                key: None,
                presented: fencing.token.get(),
                current: None,
                holder: fencing.holder.clone(),
                operation,
                other_counter: false,
                reason: Some(crate::timeline::failover_reason(lease_timeline, timeline)),
                kind: RejectionKind::Failover,
            };
            self.handle.auditor.record_beside(&rejection, lent).await;
            return Err(Error::FencedByFailover {
                target: StaleTarget::Resource(resource.to_string()),
                presented: fencing.token.get(),
                lease_timeline,
                timeline,
            });
        }
    }

    /// The error for a refused begin or finish, after logging and auditing it.
    #[allow(
        clippy::too_many_arguments,
        reason = "one private call site shape, two callers"
    )]
    async fn refused(
        &self,
        row: &PgRow,
        status: &str,
        fencing: &Fencing,
        resource: &Resource,
        work_key: &str,
        step: &str,
        operation: &'static str,
    ) -> Error {
        let current: Option<i64> = row.try_get("current").ok().flatten();
        let other_counter: bool = row
            .try_get::<Option<bool>, _>("other_counter")
            .ok()
            .flatten()
            .unwrap_or(false);
        let presented = fencing.token.get();
        let current = current.unwrap_or(presented);
        let key = effect_key_json(work_key, step);
        let target = StaleTarget::Row {
            table: EFFECT_TABLE.to_owned(),
            key: key.clone(),
            resource: Some(resource.to_string()),
            held_by: None,
        };
        let err = match status {
            "duplicate" => Error::DuplicateToken {
                target,
                token: presented,
            },
            "exhausted" => {
                return Error::RowSealed {
                    target,
                    token: presented,
                };
            }
            _ => Error::StaleToken {
                target,
                presented,
                current,
                other_counter,
            },
        };
        let kind = RejectionKind::of(&err).unwrap_or(RejectionKind::Stale);
        let rejection = Rejection {
            resource: Some(resource.to_string()),
            table: Some(EFFECT_TABLE.to_owned()),
            key: Some(key),
            presented,
            current: Some(current),
            holder: fencing.holder.clone(),
            operation,
            other_counter,
            reason: kind.reason(),
            kind,
        };
        self.handle
            .auditor
            .record(&rejection, AuditRow::Pending)
            .await;
        err
    }
}

/// A `jsonb` column read as text (pgfence builds sqlx without its `json` feature).
fn json_column(row: &PgRow, column: &str) -> Result<Option<serde_json::Value>> {
    let text: Option<String> = row.try_get(column)?;
    text.map(|t| {
        serde_json::from_str(&t).map_err(|e| {
            Error::database(sqlx::Error::Decode(
                format!("{EFFECT_TABLE}.{column} is not JSON: {e}").into(),
            ))
        })
    })
    .transpose()
}

fn effect_resource<'f>(fencing: &'f Fencing, work_key: &str, step: &str) -> Result<&'f Resource> {
    check_names(work_key, step)?;
    fencing.resource.as_ref().ok_or_else(|| {
        Error::Invalid(InvalidInput::Effect(
            "an effect is recorded under a lease: pass the Lease (or a Fencing with its resource)"
                .into(),
        ))
    })
}

fn check_names(work_key: &str, step: &str) -> Result<()> {
    for (what, value, max) in [
        ("work key", work_key, MAX_WORK_KEY_LEN),
        ("step", step, MAX_STEP_LEN),
    ] {
        if value.is_empty() || value.len() > max {
            return Err(Error::Invalid(InvalidInput::Effect(format!(
                "an effect's {what} is 1 to {max} bytes, got {}",
                value.len()
            ))));
        }
        if value.contains('\0') {
            return Err(Error::Invalid(InvalidInput::Effect(format!(
                "an effect's {what} contains a NUL byte"
            ))));
        }
    }
    Ok(())
}

/// The effect's key in errors and audit rows: `["work key", "step"]`.
fn effect_key_json(work_key: &str, step: &str) -> String {
    serde_json::json!([work_key, step]).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(check_names("invoice:42", "charge").is_ok());
        assert!(matches!(
            check_names("", "x"),
            Err(Error::Invalid(InvalidInput::Effect(_)))
        ));
        assert!(matches!(
            check_names("x", ""),
            Err(Error::Invalid(InvalidInput::Effect(_)))
        ));
        assert!(matches!(
            check_names(&"k".repeat(201), "x"),
            Err(Error::Invalid(InvalidInput::Effect(_)))
        ));
        assert!(matches!(
            check_names("a\0b", "x"),
            Err(Error::Invalid(InvalidInput::Effect(_)))
        ));
        assert_eq!(effect_key_json("a\"b", "s"), r#"["a\"b","s"]"#);
    }

    #[test]
    fn a_fencing_without_resource_is_refused() {
        let f = Fencing::new(crate::FenceToken::new(1).unwrap());
        assert!(matches!(
            effect_resource(&f, "w", "s"),
            Err(Error::Invalid(InvalidInput::Effect(_)))
        ));
    }
}
