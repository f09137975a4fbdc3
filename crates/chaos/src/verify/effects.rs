//! Effects modes (`effects`, `effects-unkeyed`): the charges, from the payment provider's
//! counts, the ledger, the invoices paid and the workers' calls (late calls, duplicates).

use std::collections::{HashMap, HashSet};

use sqlx::{PgPool, Row};

use crate::report::EffectFigures;
use crate::util::count;
use crate::worker::{BeginRecord, CallAnswer, CallRecord, Stats, invoice_item};
use crate::{ChaosError, Config, Mode};

use super::{FinalRow, ProviderTally};

/// Effects modes: one work item as the ledger has it.
pub(super) struct LedgerItem {
    work_key: String,
    state: String,
    holders: i32,
}

/// Effects modes: the ledger's charges for the run's resources.
pub(super) async fn ledger_items(
    admin: &PgPool,
    resource_prefix: &str,
) -> Result<Vec<LedgerItem>, ChaosError> {
    let rows = sqlx::query(
        "SELECT work_key, state, holders FROM pgfence.effect \
          WHERE left(resource, length($1)) = $1 AND step = $2",
    )
    .bind(resource_prefix)
    .bind(crate::worker::CHARGE_STEP)
    .fetch_all(admin)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(LedgerItem {
                work_key: r.try_get("work_key")?,
                state: r.try_get("state")?,
                holders: r.try_get("holders")?,
            })
        })
        .collect()
}

/// Effects modes: what the workers recorded of the job's side effect.
pub(super) struct Seen<'a> {
    pub(super) begins: &'a [BeginRecord],
    pub(super) calls: &'a [CallRecord],
    pub(super) stats: &'a Stats,
}

/// Effects modes: the charges' figures, from the provider's counts, the ledger, the rows'
/// final values (invoices paid) and the workers' calls.
pub(super) fn effect_figures(
    cfg: &Config,
    rows: &[FinalRow],
    ledger: &[LedgerItem],
    provider: &ProviderTally,
    seen: &Seen<'_>,
) -> EffectFigures {
    let paid: HashSet<String> = rows
        .iter()
        .flat_map(|r| (0..r.value.max(0)).map(move |n| invoice_item(r.id, n)))
        .collect();
    let in_ledger: HashSet<&str> = ledger.iter().map(|e| e.work_key.as_str()).collect();
    let charged = |item: &str| provider.charges.get(item).copied().unwrap_or(0);
    let mut duplicate_items: Vec<(String, u64)> = provider
        .charges
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(item, n)| (item.clone(), *n))
        .collect();
    duplicate_items.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let duplicate_effects = count(duplicate_items.len());
    let extra_charges = duplicate_items.iter().map(|(_, n)| n - 1).sum();
    duplicate_items.truncate(10);

    // A late call: a lease calls for an item after a newer lease's begin of it had returned.
    let mut begun: HashMap<&str, Vec<(i64, u64)>> = HashMap::new();
    for b in seen.begins {
        begun
            .entry(b.item.as_str())
            .or_default()
            .push((b.token, b.at_ms));
    }
    let (mut late, mut late_dedup, mut late_charged) = (0u64, 0u64, 0u64);
    let mut answers: HashMap<CallAnswer, u64> = HashMap::new();
    for c in seen.calls {
        *answers.entry(c.answer).or_default() += 1;
        let is_late = begun.get(c.item.as_str()).is_some_and(|bs| {
            bs.iter()
                .any(|&(token, at)| token > c.token && at < c.started_ms)
        });
        if is_late {
            late += 1;
            match c.answer {
                CallAnswer::Replayed | CallAnswer::Conflict => late_dedup += 1,
                CallAnswer::Charged => late_charged += 1,
                CallAnswer::Status(_) | CallAnswer::NoAnswer => {}
            }
        }
    }
    let answered = |a: CallAnswer| answers.get(&a).copied().unwrap_or(0);
    let calls = count(seen.calls.len());
    let ok = answered(CallAnswer::Charged)
        + answered(CallAnswer::Replayed)
        + answered(CallAnswer::Conflict);
    EffectFigures {
        keys: if cfg.mode == Mode::Effects {
            "ledger"
        } else {
            "per-lease"
        }
        .to_owned(),
        provider_latency_ms: crate::util::millis(cfg.provider_latency),
        items: count(ledger.len()),
        items_taken_over: count(ledger.iter().filter(|e| e.holders > 1).count()),
        takeovers: ledger
            .iter()
            .map(|e| u64::try_from(e.holders - 1).unwrap_or(0))
            .sum(),
        items_succeeded: count(ledger.iter().filter(|e| e.state == "succeeded").count()),
        invoices_paid: count(paid.len()),
        stalls_before_call: seen.stats.stalls_before_call,
        calls,
        calls_charged: answered(CallAnswer::Charged),
        calls_replayed: answered(CallAnswer::Replayed),
        calls_conflict: answered(CallAnswer::Conflict),
        calls_failed: calls - ok,
        late_calls: late,
        late_calls_deduplicated: late_dedup,
        late_calls_charged: late_charged,
        done_skips: seen.stats.done_skips,
        provider_requests: provider.requests,
        provider_charges: provider.charges.values().sum(),
        provider_replays: provider.replays,
        provider_conflicts: provider.conflicts,
        duplicate_effects,
        extra_charges,
        paid_uncharged: count(paid.iter().filter(|i| charged(i) == 0).count()),
        charged_unpaid: count(
            provider
                .charges
                .keys()
                .filter(|i| !paid.contains(*i))
                .count(),
        ),
        begun_uncharged: count(in_ledger.iter().filter(|i| charged(i) == 0).count()),
        stray_charges: count(
            provider
                .charges
                .keys()
                .filter(|i| !in_ledger.contains(i.as_str()))
                .count(),
        ),
        duplicate_items,
    }
}
