//! The SQL surface has a budget (issue 32): every function of schema `pgfence` has an entry in
//! docs/sql.md ("Functions": public, with who may call it, or internal), and no role but the
//! schema's owner may execute an internal one — so an application role cannot spell the
//! layout's next step (`SET fence = pgfence.next_step(fence)`) to pass the guard.

use std::collections::BTreeSet;

use sqlx::{Connection, PgConnection, PgPool};

use crate::support::{Role, TestDb};

/// docs/sql.md's "Functions" section: `(public, internal)`, the public entries with their
/// "who may call it" cell; every function as `pgfence.name(type, type)`.
fn documented() -> (Vec<(String, String)>, Vec<String>) {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/sql.md"),
    )
    .unwrap();
    let from = text
        .find("\n## Functions\n")
        .expect("docs/sql.md has a Functions section");
    let section = &text[from + 1..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |i| i + 1)];
    let internal_at = section
        .find("\n### Internal functions\n")
        .expect("an Internal functions table");
    let signatures = |cell: &str| -> Vec<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .filter(|s| s.starts_with("pgfence.") && s.ends_with(')'))
            .map(str::to_owned)
            .collect()
    };
    let rows = |part: &str| -> Vec<Vec<String>> {
        part.lines()
            .filter(|l| l.starts_with("| `pgfence."))
            .map(|l| {
                l.trim_matches('|')
                    .split(" | ")
                    .map(|c| c.trim().to_owned())
                    .collect()
            })
            .collect()
    };
    let public = rows(&section[..internal_at])
        .into_iter()
        .map(|cells| {
            let sigs = signatures(&cells[0]);
            assert_eq!(sigs.len(), 1, "one public function per row: {cells:?}");
            (sigs[0].clone(), cells[2].clone())
        })
        .collect();
    let internal = rows(&section[internal_at..])
        .iter()
        .flat_map(|cells| signatures(&cells[0]))
        .collect();
    (public, internal)
}

/// Every function of schema pgfence: its signature as docs/sql.md spells it, whether PUBLIC
/// may execute it, whether `role` may, and whether any role but the owner has a grant on it.
async fn catalog(pool: &PgPool, role: &str) -> Vec<(String, bool, bool, bool)> {
    sqlx::query_as(
        "SELECT 'pgfence.' || p.proname || '(' || coalesce((
                    SELECT string_agg(pg_catalog.format_type(u.t, NULL), ', ' ORDER BY u.o)
                      FROM unnest(p.proargtypes::oid[]) WITH ORDINALITY AS u(t, o)), '') || ')',
                coalesce(p.proacl, acldefault('f', p.proowner)) @> ARRAY[makeaclitem(0, p.proowner, 'EXECUTE', false)],
                has_function_privilege($1::regrole, p.oid, 'EXECUTE'),
                EXISTS (SELECT 1 FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
                         WHERE a.grantee <> p.proowner)
           FROM pg_proc p
          WHERE p.pronamespace = 'pgfence'::regnamespace
          ORDER BY 1",
    )
    .bind(role)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// After `migrate` and `pgfence grant`, the functions of schema pgfence are exactly the ones
/// docs/sql.md lists (each once, public or internal); a public one's "who may call it" is
/// what the catalog says; an internal one is nobody's but the owner's.
#[tokio::test]
async fn docs_list_every_function_and_who_may_call_it() {
    let db = TestDb::new().await;
    let app = Role::create(&db, "surface_app", "").await;
    pgfence::admin::grant(&db.pool, &app.ident()).await.unwrap();
    let (public, internal) = documented();

    let mut all: Vec<&String> = public.iter().map(|(s, _)| s).chain(&internal).collect();
    all.sort();
    let mut unique = all.clone();
    unique.dedup();
    assert_eq!(all, unique, "a function documented twice");
    let documented: BTreeSet<&String> = all.into_iter().collect();

    let catalog = catalog(&db.pool, &app.quoted()).await;
    let functions: BTreeSet<&String> = catalog.iter().map(|(s, ..)| s).collect();
    let missing: Vec<_> = functions.difference(&documented).collect();
    let stale: Vec<_> = documented.difference(&functions).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "functions of schema pgfence without an entry in docs/sql.md (\"Functions\"): {missing:?}; \
         entries naming no function: {stale:?}"
    );

    let internal: BTreeSet<&String> = internal.iter().collect();
    for (signature, by_public, by_app, granted) in &catalog {
        if internal.contains(signature) {
            assert!(
                !by_public && !by_app && !granted,
                "internal {signature}: PUBLIC {by_public}, application role {by_app}, granted to a role {granted}"
            );
            continue;
        }
        let who = &public.iter().find(|(s, _)| s == signature).unwrap().1;
        let actual = if *by_public {
            "any role"
        } else if *by_app {
            "application roles"
        } else {
            assert!(!granted, "{signature} is the owner's but granted");
            "the owner"
        };
        assert_eq!(who, actual, "docs/sql.md's who-may-call-it of {signature}");
    }
    // The budget as of 0.3: 40 public functions, 31 internal, 4 of them every role's (idle
    // expiry, issue 45: issuer_expire_idle and issuer_state, issuer_floor_bucket internal).
    assert_eq!((public.len(), internal.len()), (40, 31));
    assert_eq!(catalog.iter().filter(|c| c.1).count(), 4);
}

/// A database as `pgfence::admin::migrate` leaves it, with a guarded table the role may
/// update: fresh, or a 0.2.0 database (where the role had 0.2.0's grants) upgraded.
async fn app_database(upgraded: bool) -> (TestDb, Role) {
    let db = TestDb::empty().await;
    if upgraded {
        let mut conn = PgConnection::connect_with(&db.options).await.unwrap();
        crate::squash::apply_0_2_0(&mut conn).await;
        conn.close().await.unwrap();
    }
    let app = Role::create(&db, "surface_app", "").await;
    if upgraded {
        db.exec(&format!(
            "GRANT USAGE ON SCHEMA pgfence TO {r};
             GRANT EXECUTE ON FUNCTION pgfence.check(text, bigint, integer),
                 pgfence.try_check(text, bigint, integer), pgfence.high_water(text),
                 pgfence.next_fence(bigint, bigint, integer, text),
                 pgfence.lease_fence(bigint, integer) TO {r};",
            r = app.quoted()
        ))
        .await;
    }
    pgfence::admin::migrate(&db.pool).await.unwrap();
    if !upgraded {
        pgfence::admin::grant(&db.pool, &app.ident()).await.unwrap();
    }
    db.exec(&format!(
        "CREATE TABLE acct (id int PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
         INSERT INTO acct (id) VALUES (1);
         SELECT pgfence.guard('public', 'acct');
         GRANT SELECT, UPDATE ON acct TO {r};",
        r = app.quoted()
    ))
    .await;
    (db, app)
}

fn sqlstate(e: &sqlx::Error) -> String {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
        .unwrap_or_default()
}

/// An application role may execute no internal function (fresh, `pgfence grant`; or upgraded
/// from 0.2.0 with 0.2.0's grants): `SET fence = pgfence.next_step(fence)` is refused (42501)
/// and changes nothing, while the shell path's functions, which call the internal ones with
/// the owner's rights, work for it and audit it as the writer.
#[tokio::test]
async fn an_application_role_executes_no_internal_function() {
    let (_, internal) = documented();
    for upgraded in [false, true] {
        let (db, app) = app_database(upgraded).await;
        let pool = app.pool(&db).await;
        for signature in &internal {
            let may: bool = sqlx::query_scalar(
                "SELECT has_function_privilege($1::regrole, $2::regprocedure, 'EXECUTE')",
            )
            .bind(app.quoted())
            .bind(signature)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            assert!(
                !may,
                "upgraded {upgraded}: the application role may execute {signature}"
            );
        }
        if !upgraded {
            // What grant gives, and what the shell path runs as the role.
            sqlx::query(
                "UPDATE acct SET balance = 1, fence = pgfence.next_fence(fence, 5, 0, 'acct')
                  WHERE id = 1 AND pgfence.admits(fence, 5, 0, 'acct', '[1]', pgfence.timeline())",
            )
            .execute(&pool)
            .await
            .unwrap();
        } else {
            sqlx::query("UPDATE acct SET balance = 1, fence = pgfence.next_fence(fence, 5, 0, 'acct') WHERE id = 1")
                .execute(&pool)
                .await
                .unwrap();
        }
        let before: i64 = sqlx::query_scalar("SELECT fence FROM acct WHERE id = 1")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        for forged in [
            "UPDATE acct SET balance = 2, fence = pgfence.next_step(fence) WHERE id = 1",
            "SELECT pgfence.fence_token(1)",
            "SELECT pgfence.refuse_token_jump(1, 2, 'x')",
        ] {
            let err = sqlx::query(forged).execute(&pool).await.unwrap_err();
            assert_eq!(
                sqlstate(&err),
                "42501",
                "upgraded {upgraded}: {forged}: {err}"
            );
            assert!(
                err.to_string().contains("permission denied for function"),
                "{err}"
            );
        }
        let after: (i64, i64) = sqlx::query_as("SELECT fence, balance FROM acct WHERE id = 1")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(
            after,
            (before, 1),
            "upgraded {upgraded}: the row is as the lease left it"
        );
        pool.close().await;
    }

    // The shell path as the role: an older lease is refused without raising, audited with the
    // role as holder, and stop_unless ends the script; lease_fence and try_check answer.
    let (db, app) = app_database(false).await;
    let pool = app.pool(&db).await;
    let mut conn = pool.acquire().await.unwrap();
    let written = sqlx::query(
        "UPDATE acct SET balance = 1, fence = pgfence.next_fence(fence, 5, 0, 'acct')
          WHERE id = 1 AND pgfence.admits(fence, 5, 0, 'acct', '[1]')",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    assert_eq!(written.rows_affected(), 1);
    let stale = sqlx::query(
        "UPDATE acct SET balance = 2, fence = pgfence.next_fence(fence, 4, 0, 'acct')
          WHERE id = 1 AND pgfence.admits(fence, 4, 0, 'acct', '[1]')",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    assert_eq!(stale.rows_affected(), 0);
    let err = sqlx::query("SELECT pgfence.stop_unless(false, 'acct [1]')")
        .execute(&mut *conn)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err), "PF001", "{err}");
    let checks: (bool, bool, i64) = sqlx::query_as(
        "SELECT pgfence.try_check('surface', 3, 0), pgfence.try_check('surface', 2, 0),
                pgfence.lease_fence(3, 0)",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    assert_eq!(checks, (true, false, 3 << 24));
    drop(conn);
    let holders: Vec<(String, String)> =
        sqlx::query_as("SELECT holder, operation FROM pgfence.audit ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        holders,
        [
            (app.name.clone(), "update".to_owned()),
            (app.name.clone(), "check".to_owned())
        ]
    );
    pool.close().await;
}
