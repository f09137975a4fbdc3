//! The `pgfence` binary against real servers.

use crate::support;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use support::{TestDb, redis_url, unique_resource};

const BIN: &str = env!("CARGO_BIN_EXE_pgfence");

struct Cli {
    db_url: String,
    redis: String,
}

impl Cli {
    async fn new(db: &TestDb) -> Self {
        let db_url = db.url();
        Self {
            db_url,
            redis: redis_url().await,
        }
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.args(args)
            .env("DATABASE_URL", &self.db_url)
            .env("REDIS_URL", &self.redis)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null());
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().expect("run pgfence")
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "pgfence {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Runs a command that must fail with one clear line on stderr.
    fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(!out.status.success(), "pgfence {args:?} should fail");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.starts_with("pgfence: ") || err.starts_with("error: "),
            "{err}"
        );
        if err.starts_with("pgfence: ") {
            assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        }
        err
    }
}

async fn snapshot(db: &TestDb) -> (Vec<String>, i64) {
    let objects: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname || ':' || a.attname FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'public' AND a.attnum > 0 AND NOT a.attisdropped
         UNION ALL SELECT 'trigger:' || tgname FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let audit = support::audit_count(&db.pool).await;
    (objects, audit)
}

#[tokio::test]
async fn migrate_guard_and_raw_sql() {
    let db = TestDb::empty().await;
    let cli = Cli::new(&db).await;
    assert!(cli.ok(&["migrate"]).contains("applied V1__core"));
    assert!(cli.ok(&["migrate"]).contains("up to date"));
    let status = cli.ok(&["migrate", "--status"]);
    assert!(
        status.contains("V1") && !status.contains("pending"),
        "{status}"
    );

    db.exec("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint); INSERT INTO accounts VALUES (1, 100);").await;
    assert!(
        cli.ok(&["guard", "accounts"])
            .contains("guarded \"public\".\"accounts\"")
    );
    assert!(
        cli.ok(&["guard", "public.accounts"])
            .contains("already guarded")
    );
    assert!(
        cli.ok(&["tables", "--json"])
            .contains(r#""schema":"public","table":"accounts"}"#)
    );

    sqlx::query("UPDATE accounts SET balance = 5, fence = pgfence.lease_fence(3, 0)")
        .execute(&db.pool)
        .await
        .unwrap();
    let err = sqlx::query("UPDATE accounts SET balance = 0, fence = pgfence.lease_fence(2, 0)")
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert_eq!(
        err.as_database_error().unwrap().code().as_deref(),
        Some("PF001")
    );

    assert!(cli.ok(&["unguard", "accounts"]).contains("unguarded"));
    sqlx::query("UPDATE accounts SET balance = 0, fence = 2")
        .execute(&db.pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn bad_tables_change_nothing() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    db.exec(r#"CREATE TABLE victim (x int); CREATE TABLE "semi;colon" (id int);"#)
        .await;
    let before = snapshot(&db).await;
    for bad in [
        "no_such_table",
        "victim; DROP TABLE victim",
        "x\" ; DROP TABLE victim; --",
        "a.b.c",
        "\"unterminated",
        "",
    ] {
        let err = cli.fails(&["guard", bad]);
        assert!(
            err.contains("does not exist") || err.contains("bad table name"),
            "{bad}: {err}"
        );
    }
    let long = "t".repeat(64);
    assert!(
        cli.fails(&["guard", &long])
            .contains("longer than 63 bytes")
    );
    assert_eq!(snapshot(&db).await, before, "nothing changed");
    // A table whose name really contains a semicolon is guarded, by its exact name.
    assert!(cli.ok(&["guard", "semi;colon"]).contains("guarded"));
}

#[tokio::test]
async fn emit_migration_writes_the_next_version() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let dir = std::env::temp_dir().join(format!("pgfence-mig-{}", rand::random::<u64>()));
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("V1__users.sql"), "CREATE TABLE users (id int);").unwrap();
    std::fs::write(dir.join("V7__orders.rs"), "").unwrap();
    std::fs::write(dir.join("README"), "").unwrap();
    let before = snapshot(&db).await;
    let out = cli.ok(&[
        "guard",
        "billing.\"Invoices\"",
        "--emit-migration",
        dir.to_str().unwrap(),
    ]);
    let path = dir.join("V8__guard_billing_invoices.sql");
    assert!(out.contains(path.to_str().unwrap()), "{out}");
    let sql = std::fs::read_to_string(&path).unwrap();
    assert!(
        sql.contains("SELECT pgfence.guard('billing', 'Invoices');"),
        "{sql}"
    );
    assert_eq!(snapshot(&db).await, before, "the database is not touched");

    // The emitted file does what guard does.
    db.exec(r#"CREATE SCHEMA billing; CREATE TABLE billing."Invoices" (id int);"#)
        .await;
    db.exec(&sql).await;
    assert!(cli.ok(&["tables"]).contains("\"billing\".\"Invoices\""));
    assert!(
        cli.fails(&["guard", "x", "--emit-migration", "/nonexistent/dir"])
            .contains("cannot read migrations folder")
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn audit_lists_filters_and_prunes_rejections() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let fence = pgfence::Fence::new(db.pool.clone());
    let res = pgfence::Resource::new("billing:run:7").unwrap();
    fence
        .check(&db.pool, &res, support::token(5))
        .await
        .unwrap();
    let stale = pgfence::Fencing::new(support::token(4)).holder("worker\nlevel=ERROR forged");
    assert!(
        fence
            .check(&db.pool, &res, stale)
            .await
            .unwrap_err()
            .is_stale()
    );
    let other = pgfence::Resource::new("other").unwrap();
    fence
        .check(&db.pool, &other, support::token(2))
        .await
        .unwrap();
    assert!(
        fence
            .check(&db.pool, &other, support::token(1))
            .await
            .is_err()
    );

    let json: serde_json::Value =
        serde_json::from_str(&cli.ok(&["audit", "--json", "--resource", "billing:run:7"])).unwrap();
    let rows = json.as_array().unwrap();
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    for field in [
        "id",
        "at",
        "resource",
        "table",
        "key",
        "presented",
        "current",
        "holder",
        "operation",
    ] {
        assert!(row.get(field).is_some(), "missing {field}");
    }
    assert_eq!(
        (row["presented"].as_i64(), row["current"].as_i64()),
        (Some(4), Some(5))
    );
    assert_eq!(row["operation"], "check");
    assert_eq!(row["holder"], "worker\nlevel=ERROR forged");

    let human = cli.ok(&["audit", "--since", "1h"]);
    assert_eq!(human.lines().count(), 3, "header + 2 rows: {human}");
    assert!(
        human.contains("worker\\nlevel=ERROR forged"),
        "control characters escaped: {human}"
    );
    assert_eq!(cli.ok(&["audit", "--limit", "1"]).lines().count(), 2);
    assert!(
        cli.ok(&["audit", "--since", "2999-01-01T00:00:00Z"])
            .contains("no rejected writes")
    );
    assert!(
        cli.fails(&["audit", "--since", "yesterday"])
            .contains("--since")
    );

    assert!(
        cli.ok(&["audit", "prune", "--older-than", "1h"])
            .contains("pruned 0")
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        cli.ok(&["audit", "prune", "--older-than", "1ms"])
            .contains("pruned 2")
    );
    assert_eq!(support::audit_count(&db.pool).await, 0);
}

#[tokio::test]
async fn lock_acquire_status_release() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let res = unique_resource("cli-lock");
    let r = res.as_str();
    let acquired: serde_json::Value =
        serde_json::from_str(&cli.ok(&["lock", "acquire", r, "--ttl", "30s", "--json"])).unwrap();
    let token = acquired["token"].as_i64().unwrap();
    let owner = acquired["owner"].as_str().unwrap().to_owned();
    assert_eq!(owner.len(), 32);

    let status: serde_json::Value =
        serde_json::from_str(&cli.ok(&["lock", "status", r, "--json"])).unwrap();
    assert_eq!(
        (status["token"].as_i64(), status["owner"].as_str()),
        (Some(token), Some(owner.as_str()))
    );
    assert!(
        cli.fails(&["lock", "acquire", r, "--ttl", "1s"])
            .contains("locked by another holder")
    );

    // A wrong owner cannot release it.
    let wrong = cli.run(&[
        "lock",
        "release",
        r,
        "--owner",
        "deadbeef",
        "--token",
        &token.to_string(),
    ]);
    assert_eq!(wrong.status.code(), Some(2));
    let released = cli.ok(&[
        "lock",
        "release",
        r,
        "--owner",
        &owner,
        "--token",
        &token.to_string(),
        "--json",
    ]);
    assert!(released.contains("\"released\""), "{released}");
    let again = cli.run(&[
        "lock",
        "release",
        r,
        "--owner",
        &owner,
        "--token",
        &token.to_string(),
    ]);
    assert_eq!(again.status.code(), Some(2));
    assert!(cli.ok(&["lock", "status", r]).contains("free; counter=1"));
}

#[tokio::test]
async fn reseed_raises_the_counter() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let res = unique_resource("cli-reseed");
    let r = res.as_str();
    pgfence::Fence::new(db.pool.clone())
        .check(&db.pool, &res, support::token(41))
        .await
        .unwrap();
    assert!(cli.ok(&["reseed", r]).contains("raised from 0 to 41"));
    assert!(
        cli.ok(&["reseed", r, "--floor", "10"])
            .contains("unchanged")
    );
    assert!(
        cli.ok(&["lock", "acquire", r, "--ttl", "1s"])
            .contains("token=42")
    );
    assert!(
        cli.fails(&["reseed", r, "--floor", "-1"])
            .contains("negative")
    );
}

#[tokio::test]
async fn run_exports_the_token_and_propagates_the_exit_code() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let res = unique_resource("cli-run");
    let r = res.as_str();
    let out = cli.run(&[
        "run",
        "--resource",
        r,
        "--ttl",
        "2s",
        "--",
        "sh",
        "-c",
        "echo \"$PGFENCE_TOKEN $PGFENCE_RESOURCE\"; exit 7",
    ]);
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        format!("1 {r}")
    );
    assert!(
        cli.ok(&["lock", "status", r]).contains("free"),
        "released after the command exited"
    );

    let out = cli.run(&["run", "--resource", r, "--ttl", "2s", "--", "true"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        cli.fails(&[
            "run",
            "--resource",
            r,
            "--ttl",
            "2s",
            "--",
            "/no/such/program"
        ])
        .contains("cannot run")
    );
    assert!(
        cli.ok(&["lock", "status", r]).contains("free"),
        "released when the command cannot start"
    );
}

/// The README's shell job: one `pgfence run` lease, several psql transactions (a resource
/// check in each, raw row writes through `pgfence.next_fence`); then a newer lease writes,
/// and the first lease's token is fenced out.
#[tokio::test]
async fn a_shell_job_makes_several_fenced_transactions_under_one_lease() {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE invoices (id int PRIMARY KEY, status text NOT NULL);
         INSERT INTO invoices VALUES (42, 'open');
         CREATE TABLE ledger (amount int NOT NULL);",
    )
    .await;
    let cli = Cli::new(&db).await;
    cli.ok(&["guard", "invoices"]);
    let res = unique_resource("cli-shell-job");
    let r = res.as_str();
    let job = r#"
      set -e
      q() { psql "$DATABASE_URL" -qAt -v ON_ERROR_STOP=1 -c "$1"; }
      q "BEGIN; SELECT pgfence.check('$PGFENCE_RESOURCE', $PGFENCE_TOKEN, $PGFENCE_TAG); INSERT INTO ledger VALUES (1); COMMIT;"
      q "UPDATE invoices SET status = 'processing', fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG) WHERE id = 42"
      q "BEGIN; SELECT pgfence.check('$PGFENCE_RESOURCE', $PGFENCE_TOKEN, $PGFENCE_TAG); INSERT INTO ledger VALUES (2); COMMIT;"
      q "UPDATE invoices SET status = 'paid', fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG) WHERE id = 42"
      echo "$PGFENCE_TOKEN $PGFENCE_TAG"
    "#;
    let out = cli.run(&["run", "--resource", r, "--ttl", "5s", "--", "sh", "-c", job]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = String::from_utf8(out.stdout).unwrap();
    let (token, tag) = first.trim().split_once(' ').unwrap();
    let (token, tag): (i64, i32) = (token.parse().unwrap(), tag.parse().unwrap());
    let status: String = sqlx::query_scalar("SELECT status FROM invoices WHERE id = 42")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(status, "paid", "both writes of one lease applied");
    let ledger: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(ledger, 2, "both checked transactions committed");

    // A newer lease writes; the first lease's token is now stale, in SQL too.
    let newer = r#"psql "$DATABASE_URL" -qAt -v ON_ERROR_STOP=1 -c "BEGIN; SELECT pgfence.check('$PGFENCE_RESOURCE', $PGFENCE_TOKEN, $PGFENCE_TAG); UPDATE invoices SET status = 'refunded', fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG) WHERE id = 42; COMMIT;""#;
    cli.ok(&[
        "run",
        "--resource",
        r,
        "--ttl",
        "5s",
        "--",
        "sh",
        "-c",
        newer,
    ]);
    let zombie = sqlx::query(
        "UPDATE invoices SET status = 'zombie', fence = pgfence.next_fence(fence, $1, $2) WHERE id = 42",
    )
    .bind(token)
    .bind(tag)
    .execute(&db.pool)
    .await
    .unwrap_err();
    assert!(pgfence::Error::from(zombie).is_stale());
    let zombie = sqlx::query("SELECT pgfence.check($1, $2, $3)")
        .bind(r)
        .bind(token)
        .bind(tag)
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(pgfence::Error::from(zombie).is_stale());
}

/// Waits (up to 2.5 s) until `lock status` says `resource` is held.
async fn wait_until_held(cli: &Cli, resource: &str) -> bool {
    for _ in 0..50 {
        if cli.ok(&["lock", "status", resource]).contains("held by") {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Sends `signal` (`-TERM`, `-INT`) to `child` alone and waits for it to exit.
async fn signal_and_wait(mut child: std::process::Child, signal: &str) -> std::process::ExitStatus {
    Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap()
}

#[tokio::test]
async fn run_keeps_the_lease_and_releases_on_sigterm() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let res = unique_resource("cli-term");
    let r = res.as_str();
    let child = cli
        .cmd(&[
            "run",
            "--resource",
            r,
            "--ttl",
            "600ms",
            "--",
            "sleep",
            "30",
        ])
        .spawn()
        .unwrap();
    // Held, and still held after several TTLs thanks to the keep-alive.
    assert!(wait_until_held(&cli, r).await, "run took the lock");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        cli.ok(&["lock", "status", r]).contains("held by"),
        "kept alive past the TTL"
    );

    let status = signal_and_wait(child, "-TERM").await;
    assert_eq!(
        status.code(),
        Some(143),
        "exit status of the command killed by SIGTERM"
    );
    assert!(
        cli.ok(&["lock", "status", r]).contains("free"),
        "released on SIGTERM"
    );
}

#[tokio::test]
async fn run_releases_on_sigint_sent_to_pgfence_alone() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let res = unique_resource("cli-int");
    let r = res.as_str();
    let child = cli
        .cmd(&["run", "--resource", r, "--ttl", "2s", "--", "sleep", "30"])
        .spawn()
        .unwrap();
    assert!(wait_until_held(&cli, r).await, "run took the lock");
    let status = signal_and_wait(child, "-INT").await;
    assert_eq!(status.code(), Some(130), "the command got SIGINT");
    assert!(
        cli.ok(&["lock", "status", r]).contains("free"),
        "released on SIGINT"
    );
}

#[tokio::test]
async fn malformed_input_and_unreachable_servers_fail_cleanly() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    // Durations and names: clap or pgfence reject them before any connection.
    for args in [
        &["lock", "acquire", "r", "--ttl", "10 years"][..],
        &["lock", "acquire", "r", "--ttl", "-5s"],
        &["run", "--resource", "r", "--ttl", "1.5s", "--", "true"],
        &["audit", "prune", "--older-than", "soon"],
    ] {
        let out = cli.run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.starts_with("pgfence: invalid value") && err.contains("invalid duration"),
            "{args:?}: {err}"
        );
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    }
    assert!(
        cli.fails(&["lock", "acquire", "r", "--ttl", "0s"])
            .contains("TTL")
    );
    assert!(
        cli.fails(&["lock", "acquire", "r", "--ttl", "400d"])
            .contains("TTL")
    );
    assert!(
        cli.fails(&["lock", "acquire", "bad{name}", "--ttl", "1s"])
            .contains("bad resource name")
    );
    assert!(
        cli.fails(&["lock", "acquire", "has space", "--ttl", "1s"])
            .contains("bad resource name")
    );
    assert!(
        cli.fails(&["lock", "release", "r", "--owner", "x", "--token", "0"])
            .contains("bad token")
    );

    let unreachable = |pg: &str, redis: &str, args: &[&str]| {
        let out = Command::new(BIN)
            .args(args)
            .env("DATABASE_URL", pg)
            .env("REDIS_URL", redis)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        err
    };
    assert!(
        unreachable("postgres://postgres@127.0.0.1:1/x", "", &["migrate"])
            .contains("cannot connect to PostgreSQL")
    );
    assert!(unreachable("not a url", "", &["migrate"]).contains("cannot connect to PostgreSQL"));
    assert!(
        unreachable("", "redis://127.0.0.1:1", &["lock", "status", "r"])
            .contains("cannot connect to Redis")
    );
    // Not a Redis URL: not called one (issue 19); refused as an issuer URL.
    let err = unreachable("", "nope://x", &["lock", "status", "r"]);
    assert!(
        err.contains("invalid issuer URL") && !err.contains("Redis"),
        "{err}"
    );
    assert!(unreachable("postgres://u:hunter2@127.0.0.1:1/x", "", &["migrate"]).contains("u:***@"));
    let out = Command::new(BIN)
        .args(["migrate"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("no PostgreSQL URL"));
}

/// The index of the one line of `out` that contains `needle`.
fn line_of(out: &str, needle: &str) -> usize {
    let found: Vec<usize> = out
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains(needle))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(found.len(), 1, "{needle:?} once in:\n{out}");
    found[0]
}

/// The demo on a machine where the servers are installed but not running: it starts its own,
/// shows the rejection, and leaves no process or directory behind. The story: A writes step 1,
/// records the charge and pauses right before calling the provider; B claims the row, records
/// the charge (the same idempotency key), calls the provider and writes twice under one lease;
/// A, the zombie, wakes between B's two writes, calls with the same key (nothing charged) and
/// its step 2 is rejected; B's second write still applies. One charge at the provider.
#[tokio::test]
async fn simulate_starts_and_removes_its_own_servers() {
    let out = Command::new(BIN)
        .arg("simulate")
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    line_of(
        &stdout,
        "A      claims batch-42 with token 1: status = pending",
    );
    let a_first = line_of(
        &stdout,
        "A      step 1: writes status = processing by A with token 1: applied",
    );
    let a_effect = line_of(
        &stdout,
        "A      records the charge in the effect ledger: idempotency key ",
    );
    let key = stdout.lines().nth(a_effect).unwrap();
    let key = &key[key.find("idempotency key ").unwrap() + 16..][..8];
    let b_claim = line_of(
        &stdout,
        "B      claims batch-42 with token 2: status = processing by A",
    );
    let b_first = line_of(
        &stdout,
        "B      step 1: writes status = processing by B with token 2: applied",
    );
    let b_effect = line_of(
        &stdout,
        &format!(
            "B      records the charge in the effect ledger: idempotency key {key}… (the same"
        ),
    );
    let a_call = line_of(
        &stdout,
        &format!("A      calls the payment provider with Idempotency-Key {key}…"),
    );
    let a_answer = stdout
        .lines()
        .nth(a_call + 1)
        .unwrap_or_default()
        .to_owned();
    assert!(
        a_answer.contains("A      provider answers 409 Conflict")
            || a_answer.contains("replayed for the same key, nothing charged"),
        "{stdout}"
    );
    let a_rejected = line_of(
        &stdout,
        "A      step 2: writes status = paid, paid_by = A with token 1: \
         REJECTED: stale token (presented 1, current 2)",
    );
    assert!(a_first < a_effect && a_effect < b_claim && b_effect < a_call && a_call < a_rejected);
    let b_second = line_of(
        &stdout,
        "B      step 2: writes status = paid, paid_by = B with token 2: \
         applied (same lease, second write)",
    );
    assert!(
        b_claim < b_first && b_first < a_rejected && a_rejected < b_second,
        "A's rejection between B's two writes:\n{stdout}"
    );
    line_of(&stdout, "A      stops: a newer lease owns batch-42");
    assert!(
        stdout.contains(
            "provider: 1 charge(s) for batch-42; A's late call carried B's idempotency key"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "result: the row holds B's final write (status = paid, paid_by = B, fence = 2)"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("audit:  1 rejected write(s)") && stdout.contains("fencing works."),
        "{stdout}"
    );
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("pgfence::audit") && stderr.contains("presented=1 current=2"),
        "log event: {stderr}"
    );

    let dirs: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("stopped throwaway server, removed "))
        .collect();
    assert_eq!(dirs.len(), 2, "{stdout}");
    for dir in dirs {
        assert!(!std::path::Path::new(dir).exists(), "{dir} left behind");
        let procs = Command::new("pgrep").args(["-f", dir]).output().unwrap();
        assert!(procs.stdout.is_empty(), "process left behind for {dir}");
    }
}

/// With only PostgreSQL installed (the test hides redis-server), the demo says that
/// `--issuer postgres` works, and with it runs the whole race on one throwaway PostgreSQL: the
/// PostgreSQL issuer hands out tokens 1 and 2, A's stale write is rejected and audited.
#[tokio::test]
async fn simulate_runs_on_postgres_alone() {
    let run = |args: &[&str]| {
        Command::new(BIN)
            .args(args)
            .env_remove("DATABASE_URL")
            .env_remove("REDIS_URL")
            .env_remove("PGFENCE_ISSUER_URL")
            .env("PGFENCE_REDIS_SERVER", "/nonexistent/redis-server")
            .output()
            .unwrap()
    };
    let out = run(&["simulate"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("redis-server") && stderr.contains("pgfence simulate --issuer postgres"),
        "{stderr}"
    );
    let out = run(&["simulate", "--issuer", "postgres"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    line_of(&stdout, "issuer:   the PostgreSQL issuer");
    line_of(
        &stdout,
        "A      acquires the lock (TTL 300ms) -> fence token 1",
    );
    line_of(
        &stdout,
        "B      acquires the lock (TTL 700ms) -> fence token 2",
    );
    line_of(
        &stdout,
        "A      step 2: writes status = paid, paid_by = A with token 1: \
         REJECTED: stale token (presented 1, current 2)",
    );
    assert!(
        stdout.contains("audit:  1 rejected write(s)") && stdout.contains("fencing works."),
        "{stdout}"
    );
    assert!(stdout.contains("provider: 1 charge(s)"), "{stdout}");
    let dirs: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("stopped throwaway server, removed "))
        .collect();
    assert_eq!(dirs.len(), 1, "PostgreSQL only: {stdout}");
    // Unfenced, on the same issuer: A's stale writes land.
    let out = run(&["simulate", "--issuer", "postgres", "--no-fence"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("paid_by = A"), "{stdout}");
    // --issuer postgres with another issuer URL is refused.
    let out = Command::new(BIN)
        .args([
            "simulate",
            "--issuer",
            "postgres",
            "--issuer-url",
            "redis://127.0.0.1:1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--issuer postgres"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn simulate_without_fencing_shows_the_damage_and_leaves_no_demo_table() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let out = cli.ok(&["simulate", "--no-fence"]);
    // The same job without fencing (and without the ledger's key): A's writes land, its
    // step 2 over B's, and the provider charges twice.
    let a_first = line_of(
        &out,
        "A      step 1: writes status = processing by A: applied (no fence to check)",
    );
    let b_first = line_of(
        &out,
        "B      step 1: writes status = processing by B: applied (no fence to check)",
    );
    let b_second = line_of(
        &out,
        "B      step 2: writes status = paid, paid_by = B: applied (no fence to check)",
    );
    let a_second = line_of(
        &out,
        "A      step 2: writes status = paid, paid_by = A: applied (no fence to check)",
    );
    assert!(
        a_first < b_first && b_first < b_second && b_second < a_second,
        "{out}"
    );
    assert_eq!(
        out.matches("calls the payment provider without an idempotency key")
            .count(),
        2,
        "{out}"
    );
    assert!(out.contains("provider: 2 charge(s) for batch-42"), "{out}");
    assert!(!out.contains("REJECTED"), "{out}");
    assert!(
        out.contains("result: the row says status = paid, paid_by = A"),
        "{out}"
    );
    assert!(
        out.contains(
            "DAMAGE: A's stale writes (token 1, unfenced) overwrote B's newer writes (token 2)"
        ),
        "{out}"
    );
    let demo: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'pgfence_demo%'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(demo, 0);
}

#[tokio::test]
async fn simulate_mermaid_is_a_sequence_diagram() {
    let db = TestDb::new().await;
    let cli = Cli::new(&db).await;
    let out = cli.ok(&["simulate", "--mermaid"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "sequenceDiagram");
    for actor in [
        "A as Worker A",
        "R as Lock service",
        "P as Postgres",
        "V as Payment provider",
        "B as Worker B",
    ] {
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.trim() == format!("participant {actor}"))
                .count(),
            1,
            "{actor}"
        );
    }
    let arrows = lines
        .iter()
        .filter(|l| l.contains("->>") || l.contains("-->>") || l.contains("--x"))
        .count();
    assert!(arrows >= 12, "{out}");
    assert!(out.contains("P--xA: REJECTED"), "{out}");
    assert_eq!(
        out.matches("->>V: ").count(),
        2,
        "both call the provider: {out}"
    );
    assert_eq!(
        out.matches("POST /charges Idempotency-Key").count(),
        2,
        "{out}"
    );
    assert!(!out.contains("P--xB"), "{out}");
    assert_eq!(out.matches("P-->>B: applied").count(), 2, "{out}");
    assert!(
        out.contains("B->>P: ") && out.contains("claim batch-42 fence=2"),
        "{out}"
    );
    assert!(
        out.contains("step 2 UPDATE status = paid, paid_by = B fence=2"),
        "{out}"
    );
    // Every line after the header is a participant, a message, or a note.
    for l in &lines[1..] {
        let l = l.trim();
        assert!(
            l.starts_with("participant ") || l.starts_with("Note over ") || l.contains(": "),
            "not Mermaid: {l}"
        );
    }
    assert_eq!(
        support::audit_count(&db.pool).await,
        0,
        "demo audit rows removed"
    );
}
