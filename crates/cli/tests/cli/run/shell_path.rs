//! The README's shell recipe ("A cron job in shell"), run as written: under `pgfence run`
//! with `set -e`, a psql script of non-raising fenced statements followed by
//! `pgfence.stop_unless`. The live holder's refund applies; a zombie's is refused, leaves one
//! audit row per rejection and fails the job; a missing row is "not found", not stale.

use crate::support;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use support::{TestDb, audit_count, redis_url};

const BIN: &str = env!("CARGO_BIN_EXE_pgfence");

/// The README's recipe: the command `pgfence run` gets, and `refund-42.sql`.
const RECIPE_SH: &str = r#"set -e
  psql "$DATABASE_URL" -X -q -v ON_ERROR_STOP=1 -v resource="$PGFENCE_RESOURCE" \
       -v token="$PGFENCE_TOKEN" -v tag="$PGFENCE_TAG" \
       -v timeline="$PGFENCE_TIMELINE" -f refund-42.sql
  echo "refund 42 applied""#;

const RECIPE_SQL: &str = r"SELECT pgfence.try_check(:'resource', :token, :tag, :timeline) AS held \gset
SELECT pgfence.stop_unless(:'held', :'resource');
UPDATE accounts SET balance = balance + 100,
       fence = pgfence.next_fence(fence, :token, :tag, 'accounts')
 WHERE id = 42 AND pgfence.admits(fence, :token, :tag, 'accounts', '[42]', :timeline);
SELECT pgfence.stop_unless(:ROW_COUNT = 1, 'accounts [42]');
";

const RESOURCE: &str = "{billing}account:42";

async fn setup() -> (TestDb, tempdir::Dir) {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE accounts (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO accounts VALUES (42, 0);
         SELECT pgfence.guard('public', 'accounts');",
    )
    .await;
    let dir = tempdir::Dir::new();
    std::fs::write(dir.path().join("refund-42.sql"), RECIPE_SQL).unwrap();
    (db, dir)
}

/// Runs the recipe under `pgfence run` on a fresh resource name for this test's Redis.
fn run_recipe(db: &TestDb, redis: &str, dir: &Path, resource: &str) -> Output {
    Command::new(BIN)
        .args([
            "run",
            "--resource",
            resource,
            "--ttl",
            "30s",
            "--",
            "sh",
            "-c",
            RECIPE_SH,
        ])
        .current_dir(dir)
        .env("DATABASE_URL", db.url())
        .env("REDIS_URL", redis)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("run pgfence")
}

/// Runs the recipe's command as a zombie would: with an old lease's variables, no lock.
fn run_as_zombie(db: &TestDb, dir: &Path, resource: &str, token: i64, sql: &str) -> Output {
    std::fs::write(dir.join("refund-42.sql"), sql).unwrap();
    Command::new("sh")
        .args(["-c", RECIPE_SH])
        .current_dir(dir)
        .env("DATABASE_URL", db.url())
        .env("PGFENCE_RESOURCE", resource)
        .env("PGFENCE_TOKEN", token.to_string())
        .env("PGFENCE_TAG", "0")
        .env("PGFENCE_TIMELINE", "0")
        .stdin(Stdio::null())
        .output()
        .expect("run sh")
}

async fn balance(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT balance FROM accounts WHERE id = 42")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_readme_shell_recipe_applies_for_the_holder_and_stops_a_zombie_with_an_audit_row() {
    let (db, dir) = setup().await;
    let redis = redis_url().await;
    // A fencing domain unique to this run (a shared Redis outlives tests): fresh counter.
    let resource = RESOURCE.replace(
        "{billing}",
        &format!("{{billing{}}}", rand::random::<u32>()),
    );

    // The live holder (token 1 of the fresh counter), then the next one (token 2).
    for expected in [100, 200] {
        let out = run_recipe(&db, &redis, dir.path(), &resource);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "holder: {stdout}{stderr}");
        assert!(stdout.contains("refund 42 applied"), "{stdout}");
        assert_eq!(balance(&db).await, expected);
    }
    assert_eq!(audit_count(&db.pool).await, 0);

    // A zombie with token 1: its check is refused, audited, and the job stops before the
    // UPDATE and before `echo`.
    let out = run_as_zombie(&db, dir.path(), &resource, 1, RECIPE_SQL);
    let (stdout, stderr) = text(&out);
    assert!(
        !out.status.success(),
        "the zombie's job must fail: {stdout}{stderr}"
    );
    assert!(!stdout.contains("refund 42 applied"), "{stdout}");
    assert!(stderr.contains("stale fence token"), "{stderr}");
    assert_eq!(balance(&db).await, 200);
    let rows: Vec<(String, Option<String>, i64, Option<i64>)> = sqlx::query_as(
        "SELECT operation, resource, presented, current FROM pgfence.audit ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows, [("check".into(), Some(resource.clone()), 1, Some(2))]);

    // A zombie that skips the check: the row write changes nothing, is audited, and the job
    // stops.
    let write_only = RECIPE_SQL.lines().skip(2).collect::<Vec<_>>().join("\n");
    let out = run_as_zombie(&db, dir.path(), &resource, 1, &write_only);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(!stdout.contains("refund 42 applied"), "{stdout}");
    assert!(stderr.contains("recorded in pgfence.audit"), "{stderr}");
    assert_eq!(balance(&db).await, 200);
    let (operation, table, key): (String, Option<String>, Option<String>) = sqlx::query_as(
        "SELECT operation, table_name, row_key FROM pgfence.audit ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (operation.as_str(), table.as_deref(), key.as_deref()),
        ("update", Some("\"public\".\"accounts\""), Some("[42]"))
    );
    assert_eq!(
        audit_count(&db.pool).await,
        2,
        "one audit row per rejection"
    );

    // No such row: the job stops with "no such row", and nothing is audited (not stale).
    let missing = write_only.replace("id = 42", "id = 43");
    let out = run_as_zombie(&db, dir.path(), &resource, 9, &missing);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(stderr.contains("no such row"), "{stderr}");
    assert!(!stderr.contains("stale"), "{stderr}");
    assert_eq!(audit_count(&db.pool).await, 2);
}

/// A per-test temporary directory, removed when dropped.
mod tempdir {
    use std::path::{Path, PathBuf};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new() -> Self {
            let path = std::env::temp_dir().join(format!(
                "pgfence-shell-{}-{}",
                std::process::id(),
                rand::random::<u64>()
            ));
            std::fs::create_dir_all(&path).unwrap();
            Self(path)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The write-up's statement under `pgfence run`, with `$PGFENCE_FENCE`: lease 1 writes with
/// `next_fence`, lease 2 (the next `pgfence run`) takes the row over with the write-up's
/// statement, twice; lease 1's write-up statement afterwards updates 0 rows. The control:
/// the same statement with `$PGFENCE_TOKEN` updates 0 rows for the live lease 2.
#[tokio::test]
async fn the_write_ups_statement_under_pgfence_run_uses_pgfence_fence() {
    let (db, dir) = setup().await;
    let redis = redis_url().await;
    let resource = format!("writeup{}:42", rand::random::<u32>());
    let psql = |sql: &str| {
        format!(
            "psql \"$DATABASE_URL\" -X -q -t -A -v ON_ERROR_STOP=1 -c \"{sql}\"",
            sql = sql.replace('"', "\\\"")
        )
    };
    let first = psql(
        "UPDATE accounts SET balance = 1, fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG, 'accounts') WHERE id = 42 RETURNING balance",
    );
    let run = |script: String| {
        Command::new(BIN)
            .args([
                "run",
                "--resource",
                &resource,
                "--ttl",
                "30s",
                "--",
                "sh",
                "-c",
            ])
            .arg(format!(
                "set -e\n{script}\nprintf '%s %s' \"$PGFENCE_TOKEN\" \"$PGFENCE_FENCE\" > lease"
            ))
            .current_dir(dir.path())
            .env("DATABASE_URL", db.url())
            .env("REDIS_URL", &redis)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .output()
            .expect("run pgfence")
    };
    let lease = || -> (String, String) {
        let text = std::fs::read_to_string(dir.path().join("lease")).unwrap();
        let (token, fence) = text.split_once(' ').unwrap();
        (token.to_owned(), fence.to_owned())
    };
    let out = run(first);
    assert!(out.status.success(), "{:?}", text(&out));
    let (token_1, fence_1) = lease();
    assert_eq!(balance(&db).await, 1);

    // The write-up's statement, as written, with lease 2's PGFENCE_FENCE, twice.
    let write_up = |value: &str, var: &str| {
        psql(&format!(
            "UPDATE accounts SET balance = {value}, fence = ${var} WHERE id = 42 AND fence < ${var}"
        ))
        .replace("-q -t -A", "-t -A")
    };
    let out = run(format!(
        "{}\n{}",
        write_up("2", "PGFENCE_FENCE"),
        write_up("3", "PGFENCE_FENCE")
    ));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(stdout.matches("UPDATE 1").count(), 2, "{stdout}");
    assert_eq!(balance(&db).await, 3);
    let (token_2, _) = lease();
    assert_ne!(token_1, token_2);

    // Lease 1, now a zombie, with its own PGFENCE_FENCE: 0 rows, the row keeps lease 2's.
    let zombie = Command::new("sh")
        .args(["-c", &write_up("99", "PGFENCE_FENCE")])
        .current_dir(dir.path())
        .env("DATABASE_URL", db.url())
        .env("PGFENCE_FENCE", &fence_1)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&zombie.stdout).contains("UPDATE 0"));
    assert_eq!(balance(&db).await, 3);

    // The control: the live lease 3 with PGFENCE_TOKEN in the write-up's statement updates
    // 0 rows (the fence packs more than the token), which is why the docs give PGFENCE_FENCE.
    let out = run(write_up("4", "PGFENCE_TOKEN"));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("UPDATE 0"), "{stdout}");
    assert_eq!(balance(&db).await, 3);
}
