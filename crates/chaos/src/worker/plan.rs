//! Which mode runs what: the [`Plan`] of each [`Mode`] (check first or not, plain or fenced
//! write, a script per unit, the effects job).

use crate::Mode;
use crate::schema::CounterTable;

use super::Keys;
use super::script::ScriptKind;

/// How a mode's tries run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    /// The counter table read, written and recorded.
    pub(crate) table: CounterTable,
    /// Open the transaction before the read and [`pgfence::Fence::check`] the resource first
    /// in it, so the read is ordered by the check. Otherwise the read runs on its own and the
    /// transaction only holds the write and its history row.
    pub(super) check_first: bool,
    /// How the row is written.
    pub(super) write: WriteKind,
    /// One transaction per try (the plan's other fields apply), or a [`Script`] per unit.
    pub(super) script: Option<ScriptKind>,
    /// The effects modes' job (claim, record the effect, call the provider, record the
    /// outcome and the increment), with the idempotency keys it sends; it replaces the plan's
    /// other steps.
    pub(crate) effects: Option<Keys>,
}

/// How a try writes the row.
#[derive(Clone, Copy, Debug)]
pub(super) enum WriteKind {
    /// A plain `UPDATE ... SET value = $1` (no token).
    Plain,
    /// A fenced [`pgfence::Repository::update`] with the lease's token.
    Fenced,
}

impl Plan {
    /// The plan of `mode`.
    pub(crate) fn of(mode: Mode) -> Self {
        let table = CounterTable::of(mode);
        match mode {
            Mode::Fenced => Plan {
                table,
                check_first: true,
                write: WriteKind::Fenced,
                script: None,
                effects: None,
            },
            Mode::FencedMulti => Plan {
                table,
                check_first: true,
                write: WriteKind::Fenced,
                script: Some(ScriptKind::MultiCheck),
                effects: None,
            },
            // Leaseless mode: row-claim's leases; the lease-less writers run beside them.
            Mode::RowClaim | Mode::LeaselessMix => Plan {
                table,
                check_first: false,
                write: WriteKind::Fenced,
                script: Some(ScriptKind::RowClaim),
                effects: None,
            },
            Mode::Batch => Plan {
                table,
                check_first: false,
                write: WriteKind::Fenced,
                script: Some(ScriptKind::Batch),
                effects: None,
            },
            Mode::RowFence => Plan {
                table,
                check_first: false,
                write: WriteKind::Fenced,
                script: None,
                effects: None,
            },
            Mode::Unfenced => Plan {
                table,
                check_first: false,
                write: WriteKind::Plain,
                script: None,
                effects: None,
            },
            Mode::Effects | Mode::EffectsUnkeyed => Plan {
                table,
                check_first: false,
                write: WriteKind::Fenced,
                script: None,
                effects: Some(if mode == Mode::Effects {
                    Keys::Ledger
                } else {
                    Keys::PerLease
                }),
            },
        }
    }
}
