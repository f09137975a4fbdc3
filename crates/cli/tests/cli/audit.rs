//! `pgfence audit`: listing, filtering and pruning rejections, the text view's columns, and
//! `--follow` (existing rejections first, then new ones as they are recorded).

use crate::common::Cli;
use crate::common::exact_env::{ok, output, pgfence};
use crate::support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use support::{TestDb, token};

#[tokio::test]
async fn follow_prints_new_rejections_as_they_arrive() {
    let db = TestDb::new().await;
    let fence = pgfence::Fence::new(db.pool.clone());
    let res = pgfence::Resource::new("follow:me").unwrap();
    fence.check(&db.pool, &res, token(5)).await.unwrap();
    assert!(fence.check(&db.pool, &res, token(1)).await.is_err()); // an old rejection

    let mut child = Command::new(env!("CARGO_BIN_EXE_pgfence"))
        .args(["audit", "--follow", "--json", "--resource", "follow:*"])
        .env("DATABASE_URL", db.url())
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start pgfence");
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let next = |what: &str| {
        let line = rx
            .recv_timeout(Duration::from_secs(15))
            .unwrap_or_else(|_| panic!("no line for {what}"));
        serde_json::from_str::<serde_json::Value>(&line).expect("one JSON object per line")
    };
    assert_eq!(next("the existing rejection")["presented"], 1);

    // A new rejection, while it follows.
    assert!(fence.check(&db.pool, &res, token(2)).await.is_err());
    let row = next("the new rejection");
    assert_eq!(row["presented"], 2);
    assert_eq!(row["resource"], "follow:me");
    let _ = child.kill();
    let _ = child.wait();
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

/// One audit row per line, `app=` and `reason=` when recorded, quoted so that a hostile
/// `application_name` cannot forge a line or a field.
#[tokio::test]
async fn audit_text_shows_application_name_and_reason() {
    let db = TestDb::new().await;
    db.exec(
        r#"INSERT INTO pgfence.audit (resource, presented, current, holder, operation, application_name, reason)
           VALUES ('gaps:plain', 1, 2, 'w', 'check', NULL, NULL),
                  ('gaps:plain', 1, 2, 'w', 'check', '', NULL),
                  ('gaps:app', 3, 4, 'w', 'update', E'evil\n99 2099-01-01T00:00:00Z check forged', NULL),
                  ('gaps:both', 5, 6, 'w', 'bypass', 'psql', E'hotfix "42" app=forged\nsecond line')"#,
    )
    .await;
    let url = db.url();
    let env = [("DATABASE_URL", url.as_str())];

    let table = ok(&output(&env, &["audit"]));
    assert_eq!(table.lines().count(), 5, "header + 4 rows: {table}");
    let header = table.lines().next().unwrap();
    assert!(header.trim_end().ends_with("details"), "{header}");
    let row =
        |resource: &str| -> Vec<&str> { table.lines().filter(|l| l.contains(resource)).collect() };
    for plain in row("gaps:plain") {
        assert!(
            !plain.contains("app=") && !plain.contains("reason="),
            "{plain}"
        );
    }
    let app = row("gaps:app");
    assert_eq!(app.len(), 1, "{table}");
    assert!(
        app[0].ends_with(r#"app="evil\n99 2099-01-01T00:00:00Z check forged""#),
        "{}",
        app[0]
    );
    let both = row("gaps:both");
    assert_eq!(both.len(), 1, "{table}");
    assert!(
        both[0].ends_with(r#"app="psql" reason="hotfix \"42\" app=forged\nsecond line""#),
        "{}",
        both[0]
    );

    // Without either in any row: no details column.
    let plain = ok(&output(&env, &["audit", "--resource", "gaps:plain"]));
    assert!(!plain.contains("details"), "{plain}");

    // `--follow`: one line per row as well.
    let mut child = pgfence(&env, &["audit", "--follow"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start pgfence");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let lines: Vec<String> = (0..4)
        .map(|_| rx.recv_timeout(Duration::from_secs(15)).expect("a line"))
        .collect();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        rx.recv_timeout(Duration::from_millis(200)).is_err(),
        "more lines than rows: {lines:?}"
    );
    assert!(lines[0].ends_with("holder=w"), "{lines:?}");
    assert!(lines[1].ends_with("holder=w"), "{lines:?}");
    assert!(
        lines[2].ends_with(r#"holder=w app="evil\n99 2099-01-01T00:00:00Z check forged""#),
        "{lines:?}"
    );
    assert!(
        lines[3].ends_with(r#"holder=w app="psql" reason="hotfix \"42\" app=forged\nsecond line""#),
        "{lines:?}"
    );
}
