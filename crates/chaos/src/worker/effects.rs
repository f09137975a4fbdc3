//! The effects modes (`effects`, `effects-unkeyed`): the job that claims the row, records the
//! charge in the ledger, calls the payment provider and records the outcome; and what the
//! workers record of it.

use std::time::Duration;

use pgfence::effect::EffectOutcome;

use crate::Stage;
use crate::harness::EffectsCtx;
use crate::schema::{ClaimCell, Kind};
use crate::util::millis;

use super::pause::{StallBefore, stall};
use super::{Failure, Step, Try, at, db_at};

/// Where the effects modes' provider call takes its idempotency key from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Keys {
    /// [`pgfence::effect::Effect::idempotency_key`]: the same for every holder of the work item.
    Ledger,
    /// `<item>-<token>`: the classic mistake, a key per lease (a retry of the same lease
    /// reuses it; the holder that takes the work over does not).
    PerLease,
}

/// Effects modes: a lease recorded the charge of `item` in the ledger ([`pgfence::Effects::begin`]
/// returned, so it had committed by `at_ms`).
pub(crate) struct BeginRecord {
    pub(crate) item: String,
    pub(crate) token: i64,
    /// When the begin returned (ms since the run started).
    pub(crate) at_ms: u64,
}

/// Effects modes: one provider call.
pub(crate) struct CallRecord {
    pub(crate) item: String,
    pub(crate) token: i64,
    /// When the request was sent (ms since the run started).
    pub(crate) started_ms: u64,
    pub(crate) answer: CallAnswer,
}

/// What a provider call came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum CallAnswer {
    /// `200`, a new charge.
    Charged,
    /// `200` replayed for a known key: no charge.
    Replayed,
    /// `409`: the key's first request was still in flight; no charge.
    Conflict,
    /// Another status (`422`: the key came with another body).
    Status(u16),
    /// No answer (connection error, timeout): it may have charged.
    NoAnswer,
}

impl Try<'_> {
    /// The effects modes' job, a try of it: claim the row in its own transaction (the value
    /// read is the number of the row's invoices paid, so the next one is the work item) —
    /// or, when the claim reads back that this unit's payment already committed (its
    /// acknowledgement lost), stop; record the charge in the ledger (committed at once, on the
    /// pool: a holder that takes over sees the key); unless a holder recorded it done, call
    /// the provider with the key `keys` says; then, in one transaction, record the outcome,
    /// mark the invoice paid (fenced increment) and record the history row. Stalls may fall
    /// at any [`StallBefore`]. A `409` (the key in flight elsewhere) or a call without answer
    /// fails the try, retryable: a retry (or a later holder) calls again with the same key.
    pub(super) async fn run_effects(&mut self, keys: Keys) -> Step<()> {
        let ctx = self.ctx;
        let Some(fx) = ctx.effects.as_ref() else {
            return Err(Failure::Provider {
                error: "no provider".into(),
                retryable: false,
            });
        };
        stall(self.pause.at(StallBefore::Claim)).await;
        let mut tx = self.begin().await?;
        let key = (ctx.run.clone(), self.row);
        let claimed: ClaimCell = ctx
            .claim_repo
            .claim(&mut *tx, self.lease, &key)
            .await
            .map_err(at(Stage::Claim))?;
        self.read = Some(claimed.value);
        self.believed = claimed.value;
        self.applied = claimed.last_unit == self.unit_id();
        self.record(&mut tx, claimed.value, 0, 0, Kind::Claim)
            .await?;
        tx.commit().await.map_err(db_at(Stage::Commit))?;
        self.commits = 1;
        if self.applied {
            // An earlier try's payment committed; only its acknowledgement was lost.
            return Ok(());
        }
        let invoice = claimed.value;
        let item = invoice_item(self.row, invoice);

        stall(self.pause.at(StallBefore::Begin)).await;
        let effect = fx
            .ledger
            .begin(ctx.pool_of(self.worker), self.lease, &item, CHARGE_STEP)
            .await
            .map_err(at(Stage::Effect))?;
        self.begins.push(BeginRecord {
            item: item.clone(),
            token: self.lease.token().get(),
            at_ms: millis(self.clock.elapsed()),
        });
        let outcome = match effect.recorded() {
            Some(recorded @ EffectOutcome::Succeeded(_)) => {
                self.done_skip = true;
                recorded.clone()
            }
            _ => {
                stall(self.pause.at(StallBefore::Call)).await;
                let key = match keys {
                    Keys::Ledger => effect.idempotency_key().to_owned(),
                    Keys::PerLease => format!("{item}-{}", self.lease.token().get()),
                };
                self.call(fx, &item, key, invoice).await?
            }
        };

        stall(self.pause.at(StallBefore::Finish)).await;
        let mut tx = self.begin().await?;
        fx.ledger
            .finish(&mut *tx, self.lease, &effect, outcome)
            .await
            .map_err(at(Stage::Finish))?;
        let cell = ClaimCell {
            run: ctx.run.clone(),
            id: self.row,
            value: invoice + 1,
            step: 1,
            last_unit: self.unit_id(),
        };
        ctx.claim_repo
            .update(&mut *tx, self.lease, &cell)
            .await
            .map_err(at(Stage::Write))?;
        self.written = Some(invoice + 1);
        self.believed = invoice + 1;
        self.record(&mut tx, invoice, 1, 1, Kind::Increment).await?;
        tx.commit().await.map_err(db_at(Stage::Commit))?;
        self.commits = 2;
        self.applied = true;
        Ok(())
    }

    /// Effects modes: charges `item` (invoice number `invoice` of the row) at the provider with
    /// idempotency key `key`, and records the call. A `200` (a charge, or the replay of an
    /// earlier one) is the outcome to record; anything else fails the try.
    async fn call(
        &mut self,
        fx: &EffectsCtx,
        item: &str,
        key: String,
        invoice: i64,
    ) -> Step<EffectOutcome> {
        let url = fx.url.clone();
        let body_item = item.to_owned();
        let amount = 100 + invoice;
        let timeout = self.ctx.cfg.provider_latency + Duration::from_secs(2);
        let started_ms = millis(self.clock.elapsed());
        let answer = tokio::task::spawn_blocking(move || {
            pgfence_testkit::provider::charge(&url, Some(&key), &body_item, amount, timeout)
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        let (kind, result) = match answer {
            Ok(a) if a.status == 200 => {
                let detail = serde_json::json!({
                    "answer": serde_json::from_str::<serde_json::Value>(&a.body)
                        .unwrap_or(serde_json::Value::String(a.body)),
                    "replayed": a.replayed,
                });
                let kind = if a.replayed {
                    CallAnswer::Replayed
                } else {
                    CallAnswer::Charged
                };
                (kind, Ok(EffectOutcome::Succeeded(detail)))
            }
            Ok(a) if a.status == 409 => (
                CallAnswer::Conflict,
                Err(Failure::Provider {
                    error: "provider 409 conflict (the key is in flight elsewhere)".into(),
                    retryable: true,
                }),
            ),
            Ok(a) => (
                CallAnswer::Status(a.status),
                Err(Failure::Provider {
                    error: format!("provider status {}", a.status),
                    retryable: false,
                }),
            ),
            Err(e) => (
                CallAnswer::NoAnswer,
                Err(Failure::Provider {
                    error: format!("provider io {:?}", e.kind()),
                    retryable: true,
                }),
            ),
        };
        self.calls.push(CallRecord {
            item: item.to_owned(),
            token: self.lease.token().get(),
            started_ms,
            answer: kind,
        });
        result
    }
}

/// The effects modes' ledger step.
pub(crate) const CHARGE_STEP: &str = "charge";

/// The effects modes' work item: invoice number `invoice` (from 0) of counter row `row`; a
/// row's value is its number of invoices paid, so its next one is `invoice_item(row, value)`.
pub(crate) fn invoice_item(row: i32, invoice: i64) -> String {
    format!("row{row}-inv{invoice}")
}
