//! What a user reads: every user-facing error of the write path and of deploy-time calls, with
//! the words it must carry (table-driven), and every rejection's log event and audit row
//! naming its real kind.

use crate::support;

use pgfence::{
    Error, Fencing, Repository, Resource, guard::GuardMode, table::TableName, token::MAX_TOKEN,
};
use support::{Logs, Role, TestDb, token};

#[derive(Debug, Clone, sqlx::FromRow)]
struct Acct {
    id: i64,
    balance: i64,
}
pgfence::fenced_table!(Acct { table: "acct", key: id: i64, columns: [balance] });

async fn setup() -> (TestDb, Repository<Acct>) {
    let db = TestDb::new().await;
    db.exec(
        "CREATE TABLE acct (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO acct SELECT g, 0 FROM generate_series(1, 9) g;",
    )
    .await;
    pgfence::guard::guard(&db.pool, &TableName::parse("acct").unwrap())
        .await
        .unwrap();
    let repo = Repository::new(db.pool.clone()).unwrap();
    (db, repo)
}

fn lease(n: i64, holder: &str) -> Fencing {
    Fencing::new(token(n))
        .resource(Resource::new("acct:all").unwrap())
        .holder(holder)
}

fn acct(id: i64, balance: i64) -> Acct {
    Acct { id, balance }
}

async fn raw(db: &TestDb, sql: &str) -> Error {
    Error::from(
        sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&db.pool)
            .await
            .unwrap_err(),
    )
}

/// Turns a row sealed for `holder`'s lease 5: it wrote the row, then an observe-mode UPDATE
/// changed it outside the protocol.
async fn seal(db: &TestDb, repo: &Repository<Acct>, id: i64) {
    let table = TableName::parse("acct").unwrap();
    repo.update(&db.pool, lease(5, "sealed"), &acct(id, 1))
        .await
        .unwrap();
    pgfence::guard::guard_with(&db.pool, &table, GuardMode::Observe)
        .await
        .unwrap();
    db.exec(&format!("UPDATE acct SET balance = 2 WHERE id = {id}"))
        .await;
    pgfence::guard::guard_with(&db.pool, &table, GuardMode::Enforce)
        .await
        .unwrap();
}

#[tokio::test]
async fn every_user_facing_error_says_what_it_is_and_what_to_do() {
    let (db, repo) = setup().await;
    repo.update(&db.pool, lease(2, "live"), &acct(1, 1))
        .await
        .unwrap();
    repo.update(&db.pool, lease(3, "first"), &acct(2, 1))
        .await
        .unwrap();
    seal(&db, &repo, 3).await;
    let app = Role::create(&db, "msgapp", "").await;
    pgfence::admin::grant(&db.pool, &app.ident()).await.unwrap();
    let app_pool = app.pool(&db).await;
    let max = MAX_TOKEN;

    // (what happened, the error, words it must carry)
    let cases: Vec<(&str, Error, Vec<&str>)> = vec![
        (
            "stale write through the repository",
            repo.update(&db.pool, lease(1, "zombie"), &acct(1, 9))
                .await
                .unwrap_err(),
            vec![
                "stale fence token on \"public\".\"acct\" [1]",
                "presented 1, current 2",
            ],
        ),
        (
            "duplicate token",
            repo.update(&db.pool, lease(3, "other holder"), &acct(2, 9))
                .await
                .unwrap_err(),
            vec!["duplicate fence token on \"public\".\"acct\" [2]", "reseed"],
        ),
        (
            "sealed row",
            repo.update(&db.pool, lease(5, "sealed"), &acct(3, 9))
                .await
                .unwrap_err(),
            vec!["\"public\".\"acct\" [3]", "sealed", "take a new lease"],
        ),
        (
            "token jump",
            repo.update(&db.pool, lease(max, "forged"), &acct(1, 9))
                .await
                .unwrap_err(),
            vec![
                "token 549755813887 refused",
                "\"public\".\"acct\"",
                "forged or corrupted",
            ],
        ),
        (
            "a plain UPDATE (an admin's)",
            raw(&db, "UPDATE acct SET balance = 7 WHERE id = 1").await,
            vec![
                "lease-less write refused on \"public\".\"acct\"",
                "left fence as it was",
                "pgfence.bypass",
            ],
        ),
        (
            "a token set where the fence belongs (fresh row)",
            raw(&db, "UPDATE acct SET balance = 7, fence = 2 WHERE id = 4").await,
            vec![
                "fence token, not a fence",
                "PGFENCE_FENCE",
                "Porting hand-written fenced SQL",
            ],
        ),
        (
            "a token set where the fence belongs (written row)",
            raw(&db, "UPDATE acct SET balance = 7, fence = 3 WHERE id = 1").await,
            vec![
                "stale fence token on \"public\".\"acct\"",
                "presented 0, current 2",
                "PGFENCE_FENCE",
            ],
        ),
        (
            "raw next_fence without its table argument",
            raw(
                &db,
                "UPDATE acct SET fence = pgfence.next_fence(fence, 1, 0) WHERE id = 1",
            )
            .await,
            vec![
                "stale fence token on a row of a table pgfence.next_fence was not told",
                "4th argument",
            ],
        ),
        (
            "a database error",
            raw(&db, "UPDATE no_such_table SET x = 1").await,
            vec!["no_such_table"],
        ),
        (
            "SQL that does not parse",
            raw(&db, "UPDATE acct SET WHERE").await,
            vec!["database error: syntax error", "SQLSTATE 42601"],
        ),
        (
            "guard as the application role",
            pgfence::guard::guard(&app_pool, &TableName::parse("acct").unwrap())
                .await
                .unwrap_err(),
            vec!["pgfence guard refused", "deploy-time call", "owner"],
        ),
        (
            "grant as the application role",
            pgfence::admin::grant(&app_pool, &app.ident())
                .await
                .unwrap_err(),
            vec![
                "pgfence grant refused",
                "deploy-time call",
                "owner of schema pgfence",
            ],
        ),
        (
            "allow_bypass as the application role",
            pgfence::guard::allow_bypass(&app_pool, &app.name)
                .await
                .unwrap_err(),
            vec!["allow_bypass refused", "deploy-time call"],
        ),
    ];
    for (what, err, words) in &cases {
        let text = err.to_string();
        for word in words {
            assert!(text.contains(word), "{what}: {text:?} lacks {word:?}");
        }
        assert!(!text.contains(" at line "), "{what}: {text}");
    }
}

/// One kind per path: the log event's `kind` field and message, and the audit row's
/// `reason`, name what the rejection was.
#[tokio::test]
async fn each_rejection_logs_and_audits_its_kind() {
    let (logs, _guard) = Logs::capture();
    let (db, repo) = setup().await;
    repo.update(&db.pool, lease(2, "live"), &acct(1, 1))
        .await
        .unwrap();
    repo.update(&db.pool, lease(3, "first"), &acct(2, 1))
        .await
        .unwrap();
    seal(&db, &repo, 3).await;
    let before: i64 = sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM pgfence.audit")
        .fetch_one(&db.pool)
        .await
        .unwrap();

    // On the pool (the rejecting statement writes the audit row) and inside a transaction
    // (the auditor's pool writes it).
    for in_tx in [false, true] {
        let mut tx = db.pool.begin().await.unwrap();
        let mut write = async |f: Fencing, row: Acct| {
            if in_tx {
                repo.update(&mut *tx, f, &row).await.unwrap_err()
            } else {
                repo.update(&db.pool, f, &row).await.unwrap_err()
            }
        };
        assert!(write(lease(1, "zombie"), acct(1, 9)).await.is_stale());
        assert!(write(lease(3, "twin"), acct(2, 9)).await.is_duplicate());
        let sealed = write(lease(5, "sealed"), acct(3, 9)).await;
        assert!(matches!(sealed, Error::RowSealed { .. }), "{sealed:?}");
        drop(tx);
    }
    let rows: Vec<(Option<String>, String)> =
        sqlx::query_as("SELECT reason, row_key FROM pgfence.audit WHERE id > $1 ORDER BY id")
            .bind(before)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let reasons: Vec<Option<&str>> = rows
        .iter()
        .map(|(r, _)| r.as_deref().map(|r| r.split(':').next().unwrap()))
        .collect();
    let one_round = [None, Some("duplicate token"), Some("sealed")];
    assert_eq!(reasons, [one_round, one_round].concat(), "{rows:?}");

    let events = logs.with("pgfence::audit", "WARN");
    let kinds: Vec<(&str, &str)> = events
        .iter()
        .map(|e| {
            (
                e["fields"]["kind"].as_str().unwrap(),
                e["fields"]["message"].as_str().unwrap(),
            )
        })
        .collect();
    let one_round = [
        ("stale", "stale write rejected"),
        ("duplicate", "write rejected: duplicate fence token"),
        ("sealed", "write rejected: row sealed"),
    ];
    assert_eq!(kinds, [one_round, one_round].concat());
}

#[derive(Debug, Clone, sqlx::FromRow)]
struct Plain {
    id: i64,
    note: String,
}
pgfence::fenced_table!(Plain { table: "plain", key: id: i64, columns: [note] });

/// An error's cause chain as `{:#}` prints it (anyhow's format): each cause after a `: `.
fn chain(err: Error) -> String {
    format!("{:#}", anyhow::Error::from(err))
}

/// What a printed chain must not do (issue 48): end in PostgreSQL's C source line, or say one
/// cause's text twice.
fn assert_reads_once(what: &str, chain: &str) {
    assert!(!chain.contains(" at line "), "{what}: {chain}");
    let parts: Vec<&str> = chain.split(": ").filter(|p| p.len() > 12).collect();
    for (i, part) in parts.iter().enumerate() {
        assert!(
            !parts[..i].iter().any(|before| before.contains(part)),
            "{what}: {part:?} said twice in {chain}"
        );
    }
}

/// A role `pgfence grant` never ran for, a table `pgfence guard` never ran on, and a database
/// error: each reads as pgfence's (issue 48): what to do, no `at line N` of PostgreSQL's C
/// source, no cause said twice in the chain.
#[tokio::test]
async fn errors_of_a_setup_step_not_taken_name_the_step() {
    let (db, repo) = setup().await;
    db.exec(
        "CREATE TABLE plain (id bigint PRIMARY KEY, note text NOT NULL);
         INSERT INTO plain VALUES (1, 'a');",
    )
    .await;
    let stranger = Role::create(&db, "msgnogrant", "").await;
    db.exec(&format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON acct TO {}",
        stranger.quoted()
    ))
    .await;
    let pool = stranger.pool(&db).await;
    let as_stranger = Repository::<Acct>::new(pool.clone()).unwrap();
    let resource = Resource::new("acct:all").unwrap();
    let not_granted = [
        (
            "update",
            as_stranger
                .update(&pool, lease(7, "w"), &acct(1, 1))
                .await
                .unwrap_err(),
        ),
        (
            "claim",
            as_stranger
                .claim::<_, Acct>(&pool, lease(7, "w"), &1)
                .await
                .unwrap_err(),
        ),
        ("verify", as_stranger.verify(&pool).await.unwrap_err()),
        (
            "check",
            pgfence::Fence::new(pool.clone())
                .check(&pool, &resource, token(7))
                .await
                .unwrap_err(),
        ),
    ];
    for (what, err) in not_granted {
        assert!(matches!(err, Error::NotGranted { .. }), "{what}: {err:?}");
        assert_eq!(err.kind(), pgfence::error::ErrorKind::Setup, "{what}");
        let text = chain(err);
        assert!(
            text.contains("lacks pgfence's grants") && text.contains("`pgfence grant ROLE`"),
            "{what}: {text}"
        );
        assert_reads_once(what, &text);
    }

    let plain = Repository::<Plain>::new(db.pool.clone()).unwrap();
    let row = Plain {
        id: 1,
        note: "b".into(),
    };
    let not_guarded = [
        (
            "update",
            plain
                .update(&db.pool, lease(7, "w"), &row)
                .await
                .unwrap_err(),
        ),
        (
            "upsert",
            plain
                .upsert(&db.pool, lease(7, "w"), &row)
                .await
                .unwrap_err(),
        ),
        (
            "claim",
            plain
                .claim::<_, Plain>(&db.pool, lease(7, "w"), &1)
                .await
                .unwrap_err(),
        ),
        (
            "update_many",
            plain
                .update_many(&db.pool, lease(7, "w"), std::slice::from_ref(&row))
                .await
                .unwrap_err(),
        ),
    ];
    for (what, err) in not_guarded {
        assert!(
            matches!(&err, Error::NotGuarded { table } if table == "\"public\".\"plain\""),
            "{what}: {err:?}"
        );
        let text = chain(err);
        assert!(
            text.contains("table \"public\".\"plain\" is not guarded")
                && text.contains("run `pgfence guard \"public\".\"plain\"`"),
            "{what}: {text}"
        );
        assert!(!text.contains("does not exist"), "{what}: {text}");
        assert_reads_once(what, &text);
    }
    let note: String = sqlx::query_scalar("SELECT note FROM plain WHERE id = 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(note, "a", "nothing was applied");

    // PostgreSQL's own errors: message and SQLSTATE once, not sqlx's `at line N` after them.
    for (what, sql) in [
        ("syntax error", "UPDATE acct SET WHERE"),
        ("missing column", "UPDATE acct SET nope = 1"),
        (
            "a lease-less write",
            "UPDATE acct SET balance = 7 WHERE id = 1",
        ),
    ] {
        let text = chain(raw(&db, sql).await);
        assert_reads_once(what, &text);
    }
    let text = chain(raw(&db, "UPDATE acct SET WHERE").await);
    assert!(text.contains("(SQLSTATE 42601)"), "{text}");
    drop(repo);
}
