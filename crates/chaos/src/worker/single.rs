//! The single-transaction modes (`fenced`, `row-fence`, `unfenced`): a try is (check,) read,
//! write, record, commit, the write plain or fenced as the plan says.

use sqlx::PgConnection;
use tokio::time::Instant;

use crate::schema::{Cell, Kind, WRITE_PLAIN};
use crate::util::millis;
use crate::{LibraryCall, Stage};

use super::pause::stall;
use super::plan::WriteKind;
use super::{Step, Try, at, db_at};

impl Try<'_> {
    /// Runs the plan's steps: (check,) read, write, record, commit.
    pub(super) async fn run(&mut self) -> Step<()> {
        let plan = self.ctx.plan;
        stall(self.pause.before_read()).await;
        let mut early_tx = None;
        if plan.check_first {
            let mut tx = self.begin().await?;
            self.ctx
                .fence
                .check(&mut *tx, self.lease.resource(), self.lease)
                .await
                .map_err(at(Stage::Check))?;
            early_tx = Some(tx);
        }
        let value = self.read_value(early_tx.as_deref_mut()).await?;
        self.read = Some(value);
        stall(self.pause.before_write()).await;
        let mut tx = match early_tx {
            Some(tx) => tx,
            None => self.begin().await?,
        };
        self.write_value(&mut tx, value + 1).await?;
        self.written = Some(value + 1);
        self.record(&mut tx, value, 0, 0, Kind::Increment).await?;
        tx.commit().await.map_err(db_at(Stage::Commit))?;
        self.commits = 1;
        Ok(())
    }

    /// Writes `value` to the row as the plan says.
    pub(super) async fn write_value(&mut self, conn: &mut PgConnection, value: i64) -> Step<()> {
        let run = self.ctx.run.as_str();
        match self.ctx.plan.write {
            WriteKind::Plain => {
                sqlx::query(WRITE_PLAIN)
                    .bind(run)
                    .bind(self.row)
                    .bind(value)
                    .execute(conn)
                    .await
                    .map_err(db_at(Stage::Write))?;
            }
            WriteKind::Fenced => {
                let cell = Cell {
                    run: run.to_owned(),
                    id: self.row,
                    value,
                };
                let started = Instant::now();
                let written = self.ctx.repo.update(conn, self.lease, &cell).await;
                self.library.push(LibraryCall {
                    op: "update",
                    worker: self.worker,
                    at_ms: millis(started.duration_since(self.clock)),
                    duration_us: u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
                    bound_ms: millis(self.ctx.repo.call_timeout()),
                    ok: written.is_ok(),
                });
                written.map_err(at(Stage::Write))?;
            }
        }
        Ok(())
    }
}
