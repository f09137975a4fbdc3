//! The CLI against the components production users put around pgfence: a PostgreSQL that
//! accepts TLS only (`ssl = on`, `hostssl` lines, certificates made per run, a client
//! certificate user), Debian's PgBouncer in transaction and session mode, the least-privilege
//! application role, a hostile `search_path`, and the URLs people paste.

use crate::support;

use std::net::Ipv4Addr;
use std::process::{Command, Output, Stdio};

use pgfence_testkit::{Certs, Installed, PgBouncer, PoolMode, Proxy, Server, needs, optional};
use sqlx::{AssertSqlSafe, Connection, PgConnection, Row};
use support::{Role, TestDb, redis_url, unique_resource};

const BIN: &str = env!("CARGO_BIN_EXE_pgfence");

/// The `pgfence` binary under test: `PGFENCE_CLI_BIN` when set (CI points it at the CLI
/// built as `cargo install` builds it, without the workspace's feature unification), else
/// the one cargo built for this test.
fn bin() -> String {
    std::env::var("PGFENCE_CLI_BIN")
        .ok()
        .filter(|b| !b.is_empty())
        .unwrap_or_else(|| BIN.to_owned())
}

fn run(env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .env_remove("PGFENCE_ISSUER_URL")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run pgfence")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[track_caller]
fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

#[track_caller]
fn fails(out: &Output, what: &str) -> String {
    assert!(
        !out.status.success(),
        "{what} should fail: {}",
        text(&out.stdout)
    );
    assert_ne!(
        out.status.code(),
        Some(101),
        "{what} panicked: {}",
        text(&out.stderr)
    );
    text(&out.stderr)
}

/// A TLS-only PostgreSQL with a database for one test.
struct TlsPg {
    certs: Certs,
    server: Server,
}

impl TlsPg {
    async fn start() -> Self {
        let certs = Certs::generate().expect("certificates");
        let server = Server::postgres_tls(&certs).await.expect("TLS PostgreSQL");
        Self { certs, server }
    }

    fn url(&self, user: &str, extra: &str) -> String {
        format!(
            "postgres://{user}@localhost:{}/postgres?{extra}",
            self.server.port()
        )
    }
}

#[tokio::test]
async fn tls_only_postgres_every_admin_command_and_the_lock_commands() {
    let pg = TlsPg::start().await;
    let ca = pg.certs.ca().display().to_string();
    let verify_full = pg.url("postgres", &format!("sslmode=verify-full&sslrootcert={ca}"));
    // The server really refuses plaintext: the hba file has no `host` line.
    let plain = run(
        &[("DATABASE_URL", &pg.url("postgres", "sslmode=disable"))],
        &["migrate"],
    );
    let err = fails(&plain, "migrate with sslmode=disable");
    assert!(
        err.contains("no encryption") || err.contains("pg_hba.conf"),
        "{err}"
    );

    let env = [("DATABASE_URL", verify_full.as_str())];
    let out = ok(&run(&env, &["migrate"]), "migrate over verify-full");
    assert!(out.contains("applied V1__core"), "{out}");
    let mut admin = PgConnection::connect(&verify_full)
        .await
        .expect("library over TLS");
    let ssl: bool = sqlx::query_scalar(
        "SELECT ssl FROM pg_catalog.pg_stat_ssl WHERE pid = pg_catalog.pg_backend_pid()",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert!(ssl, "the library's own connection is TLS");
    sqlx::raw_sql("CREATE TABLE acct (id int PRIMARY KEY, balance int NOT NULL)")
        .execute(&mut admin)
        .await
        .unwrap();
    ok(&run(&env, &["guard", "acct"]), "guard");
    assert!(ok(&run(&env, &["tables"]), "tables").contains("acct"));
    ok(&run(&env, &["audit"]), "audit");
    ok(&run(&env, &["doctor", "--no-redis"]), "doctor");
    ok(&run(&env, &["migrate", "--status"]), "migrate --status");

    // No sslmode: libpq's `prefer`, which takes TLS when the server offers it (a plaintext
    // connection would be refused by this server).
    let prefer = pg.url("postgres", "");
    ok(
        &run(&[("DATABASE_URL", &prefer)], &["tables"]),
        "tables with the default sslmode",
    );
    // `require` (encrypt, no verification) and `verify-ca`.
    ok(
        &run(
            &[("DATABASE_URL", &pg.url("postgres", "sslmode=require"))],
            &["tables"],
        ),
        "sslmode=require",
    );
    ok(
        &run(
            &[(
                "DATABASE_URL",
                &pg.url("postgres", &format!("sslmode=verify-ca&sslrootcert={ca}")),
            )],
            &["tables"],
        ),
        "sslmode=verify-ca",
    );
    // verify-full against a CA that did not sign the server's certificate: refused, not
    // downgraded.
    let other = Certs::generate().unwrap();
    let wrong = pg.url(
        "postgres",
        &format!("sslmode=verify-full&sslrootcert={}", other.ca().display()),
    );
    let err = fails(&run(&[("DATABASE_URL", &wrong)], &["tables"]), "wrong CA");
    assert!(err.contains("cannot connect to PostgreSQL"), "{err}");
    // verify-full checks the host name: 127.0.0.2 is not in the certificate.
    let wrong_host = format!(
        "postgres://postgres@127.0.0.2:{}/postgres?sslmode=verify-full&sslrootcert={ca}",
        pg.server.port()
    );
    let out = run(&[("DATABASE_URL", &wrong_host)], &["tables"]);
    fails(
        &out,
        "verify-full with a host the certificate does not name",
    );

    // Client certificates: `certuser` logs in with `cert` authentication only.
    sqlx::raw_sql("CREATE ROLE certuser LOGIN; GRANT USAGE ON SCHEMA pgfence TO certuser")
        .execute(&mut admin)
        .await
        .unwrap();
    let (cert, key) = pg.certs.client("certuser").unwrap();
    let without = pg.url("certuser", &format!("sslmode=verify-full&sslrootcert={ca}"));
    fails(
        &run(&[("DATABASE_URL", &without)], &["tables"]),
        "cert auth without a certificate",
    );
    let with = pg.url(
        "certuser",
        &format!(
            "sslmode=verify-full&sslrootcert={ca}&sslcert={}&sslkey={}",
            cert.display(),
            key.display()
        ),
    );
    let out = run(&[("DATABASE_URL", &with)], &["doctor", "--no-redis"]);
    let stdout = text(&out.stdout);
    assert!(
        !text(&out.stderr).contains("cannot connect"),
        "client certificate accepted: {}",
        text(&out.stderr)
    );
    assert!(
        stdout.contains("not_permitted") || stdout.contains("lacks"),
        "{stdout}"
    );

    // A keyword conninfo string, as libpq takes it.
    let conninfo = format!(
        "host=localhost port={} user=postgres dbname=postgres sslmode=verify-full sslrootcert='{ca}'",
        pg.server.port()
    );
    ok(
        &run(&[("DATABASE_URL", &conninfo)], &["tables"]),
        "keyword conninfo",
    );

    // The lock commands with the PostgreSQL issuer over TLS, and `run` with a Redis issuer
    // recovering its counter from the TLS PostgreSQL (no "cannot be recovered" warning).
    let r = unique_resource("tls").as_str().to_owned();
    let lock_env = [("PGFENCE_ISSUER_URL", verify_full.as_str())];
    let out = ok(
        &run(&lock_env, &["lock", "acquire", &r, "--ttl", "5s", "--json"]),
        "lock acquire",
    );
    assert!(out.contains("\"token\""), "{out}");
    let redis = redis_url().await;
    let out = run(
        &[
            ("DATABASE_URL", verify_full.as_str()),
            ("REDIS_URL", &redis),
        ],
        &[
            "run",
            "--resource",
            &format!("{r}-redis"),
            "--ttl",
            "5s",
            "--",
            "true",
        ],
    );
    ok(&out, "run with a TLS floor source");
    assert!(
        !text(&out.stderr).contains("cannot be recovered"),
        "{}",
        text(&out.stderr)
    );
}

#[tokio::test]
async fn prefer_against_a_remote_plaintext_server_warns_once() {
    // This machine's non-loopback address, if it has one: the client must see a host that is
    // not loopback (a plaintext server on loopback is not worth a warning).
    let Some(ip) = local_ipv4() else {
        eprintln!("skipped: no non-loopback IPv4 address on this machine");
        return;
    };
    let db = TestDb::new().await;
    let proxy = Proxy::start_on(ip, db.options.get_port()).expect("proxy");
    let url = format!("postgres://postgres@{ip}:{}/{}", proxy.port(), db.name);
    let out = run(&[("DATABASE_URL", &url)], &["tables"]);
    ok(&out, "tables over plaintext");
    let err = text(&out.stderr);
    assert_eq!(err.matches("refused TLS").count(), 1, "warned once: {err}");
    assert!(
        err.contains("sslmode=verify-full"),
        "names the mode to insist: {err}"
    );
    // `sslmode=disable` is a choice: no warning; loopback: no warning.
    let out = run(
        &[("DATABASE_URL", &format!("{url}?sslmode=disable"))],
        &["tables"],
    );
    assert!(
        !text(&out.stderr).contains("refused TLS"),
        "{}",
        text(&out.stderr)
    );
    let out = run(&[("DATABASE_URL", &db.url())], &["tables"]);
    assert!(
        !text(&out.stderr).contains("refused TLS"),
        "{}",
        text(&out.stderr)
    );
}

fn local_ipv4() -> Option<Ipv4Addr> {
    // The address a UDP socket would send from (nothing is sent).
    let socket = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).ok()?;
    socket.connect((Ipv4Addr::new(192, 0, 2, 1), 9)).ok()?;
    match socket.local_addr().ok()?.ip() {
        std::net::IpAddr::V4(ip) if !ip.is_loopback() && !ip.is_unspecified() => Some(ip),
        _ => None,
    }
}

/// What a server connection holds of its last client's session: settings, prepared
/// statements, advisory locks. Read over the same pooler (a pool of one server connection)
/// with the simple query protocol, so the read itself leaves nothing.
async fn server_state(url: &str) -> (String, String, i64, i64) {
    let mut conn = PgConnection::connect(url)
        .await
        .expect("connect through PgBouncer");
    let row = sqlx::raw_sql(
        "SELECT pg_catalog.current_setting('search_path'), pg_catalog.current_setting('lock_timeout'),
                (SELECT pg_catalog.count(*) FROM pg_catalog.pg_prepared_statements),
                (SELECT pg_catalog.count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory'
                    AND pid = pg_catalog.pg_backend_pid())",
    )
    .fetch_one(&mut conn)
    .await
    .expect("read the server connection's state");
    let state = (
        row.get::<String, _>(0),
        row.get::<String, _>(1),
        row.get::<i64, _>(2),
        row.get::<i64, _>(3),
    );
    conn.close().await.ok();
    state
}

async fn admin_commands_through(pgbouncer: Installed<optional::PgBouncer>, mode: PoolMode) {
    let db = TestDb::empty().await;
    db.exec("CREATE TABLE acct (id int PRIMARY KEY, balance int NOT NULL)")
        .await;
    let app = Role::create(&db, "pgb_app", "").await;
    // One server connection: every client of the bouncer shares it.
    let bouncer =
        PgBouncer::start_with_users(pgbouncer, db.options.get_port(), mode, 1, &[&app.name])
            .await
            .expect("PgBouncer");
    let url = bouncer.url(&db.name);
    let env = [("DATABASE_URL", url.as_str())];
    let baseline = server_state(&url).await;
    // Twice each: a prepared statement left by the first run would make the second fail
    // (`prepared statement "sqlx_s_1" already exists`).
    for round in 0..2 {
        let out = ok(&run(&env, &["migrate"]), "migrate");
        if round == 1 {
            assert!(out.contains("up to date"), "{out}");
        }
        ok(&run(&env, &["migrate", "--status"]), "migrate --status");
        ok(
            &run(&env, &["guard", "acct", "--lock-timeout", "2s"]),
            "guard",
        );
        ok(&run(&env, &["tables", "--json"]), "tables");
        ok(&run(&env, &["grant", &app.name]), "grant");
        ok(&run(&env, &["audit"]), "audit");
        ok(
            &run(&env, &["audit", "prune", "--older-than", "1d"]),
            "audit prune",
        );
        ok(&run(&env, &["doctor", "--no-redis"]), "doctor");
        let state = server_state(&url).await;
        assert_eq!(
            state, baseline,
            "{mode:?} round {round}: the shared server connection kept the CLI's session state \
             (search_path, lock_timeout, prepared statements, advisory locks)"
        );
    }
    ok(&run(&env, &["unguard", "acct"]), "unguard");
    assert_eq!(server_state(&url).await, baseline);
    drop(bouncer);
}

#[tokio::test]
async fn admin_commands_through_pgbouncer_in_transaction_mode_leave_nothing_behind() {
    let Some(pgbouncer) = needs::<optional::PgBouncer>(
        "admin_commands_through_pgbouncer_in_transaction_mode_leave_nothing_behind",
    ) else {
        return;
    };
    admin_commands_through(pgbouncer, PoolMode::Transaction).await;
}

#[tokio::test]
async fn admin_commands_through_pgbouncer_in_session_mode() {
    let Some(pgbouncer) =
        needs::<optional::PgBouncer>("admin_commands_through_pgbouncer_in_session_mode")
    else {
        return;
    };
    admin_commands_through(pgbouncer, PoolMode::Session).await;
}

#[tokio::test]
async fn the_application_role_at_run_time() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE acct (id int PRIMARY KEY, balance int NOT NULL)")
        .await;
    ok(
        &run(&[("DATABASE_URL", &db.url())], &["guard", "acct"]),
        "guard as owner",
    );
    let app = Role::create(&db, "rt_app", "").await;
    // An earlier, too generous grant: CREATE on pgfence's schema.
    db.exec(&format!(
        "GRANT CREATE ON SCHEMA pgfence TO {}",
        app.quoted()
    ))
    .await;
    let owner_env = [("DATABASE_URL", db.url())];
    let owner_env: Vec<(&str, &str)> = owner_env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    ok(&run(&owner_env, &["grant", &app.name]), "grant");
    let create: bool = sqlx::query_scalar("SELECT has_schema_privilege($1, 'pgfence', 'CREATE')")
        .bind(&app.name)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(!create, "grant took back CREATE on schema pgfence");
    let err = fails(&run(&owner_env, &["grant", "public"]), "grant public");
    assert!(err.contains("PUBLIC"), "{err}");
    let err = fails(&run(&owner_env, &["grant", "PUBLIC"]), "grant PUBLIC");
    assert!(err.contains("PUBLIC"), "{err}");

    let app_url = format!(
        "postgres://{}@{}:{}/{}",
        app.name,
        db.options.get_host(),
        db.options.get_port(),
        db.name
    );
    let app_env = [("DATABASE_URL", app_url.as_str())];
    // `migrate` on a current schema: nothing to do, no privilege needed.
    let out = ok(
        &run(&app_env, &["migrate"]),
        "migrate as the application role",
    );
    assert!(out.contains("up to date"), "{out}");
    let pool = app.pool(&db).await;
    assert!(pgfence::admin::migrate(&pool).await.unwrap().is_empty());
    // `doctor` says what it could not check, and why — not "migration failed".
    let out = run(&app_env, &["doctor", "--no-redis", "--json"]);
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(!all.contains("migration failed"), "{all}");
    assert!(all.contains("not_permitted"), "{all}");
    assert!(all.contains("SELECT on pgfence.guarded_table"), "{all}");
    // `guard` is deploy-time: refused with a word on who may.
    let err = fails(
        &run(&app_env, &["guard", "acct"]),
        "guard as the application role",
    );
    assert!(err.contains("deploy-time"), "{err}");

    // A schema behind this version (its newest migration not recorded; the 0.3 migration
    // applies again over itself): the application role is told to ask the owner.
    db.exec(
        "DELETE FROM pgfence.refinery_schema_history
          WHERE version = (SELECT max(version) FROM pgfence.refinery_schema_history)",
    )
    .await;
    let err = pgfence::admin::migrate(&pool).await.unwrap_err();
    assert!(
        matches!(err, pgfence::Error::MigrationNotPermitted { .. }),
        "{err:?}"
    );
    let err = fails(
        &run(&app_env, &["migrate"]),
        "migrate a behind schema as the app role",
    );
    assert!(err.contains("owner of schema pgfence"), "{err}");
    // The owner brings it back.
    ok(&run(&owner_env, &["migrate"]), "migrate as owner");
    assert!(pgfence::admin::migrate(&pool).await.unwrap().is_empty());
}

/// Functions and operators in schema `evil` with the names pgfence's statements use, each
/// raising: first on the database's and the role's search_path, they would run with the
/// caller's (the admin's) rights on any unqualified call.
const EVIL: &str = r"
CREATE SCHEMA evil;
CREATE FUNCTION evil.boom() RETURNS text LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'hijacked by evil'; END $$;
CREATE FUNCTION evil.set_config(text, text, boolean) RETURNS text LANGUAGE sql AS 'SELECT evil.boom()';
CREATE FUNCTION evil.current_setting(text) RETURNS text LANGUAGE sql AS 'SELECT evil.boom()';
CREATE FUNCTION evil.to_regnamespace(text) RETURNS regnamespace LANGUAGE sql AS 'SELECT evil.boom()::regnamespace';
CREATE FUNCTION evil.to_regclass(text) RETURNS regclass LANGUAGE sql AS 'SELECT evil.boom()::regclass';
CREATE FUNCTION evil.to_regprocedure(text) RETURNS regprocedure LANGUAGE sql AS 'SELECT evil.boom()::regprocedure';
CREATE FUNCTION evil.has_schema_privilege(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT evil.boom() IS NULL';
CREATE FUNCTION evil.has_schema_privilege(oid, text) RETURNS boolean LANGUAGE sql AS 'SELECT evil.boom() IS NULL';
CREATE FUNCTION evil.has_table_privilege(oid, text) RETURNS boolean LANGUAGE sql AS 'SELECT evil.boom() IS NULL';
CREATE FUNCTION evil.has_table_privilege(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT evil.boom() IS NULL';
CREATE FUNCTION evil.has_function_privilege(oid, text) RETURNS boolean LANGUAGE sql AS 'SELECT evil.boom() IS NULL';
CREATE FUNCTION evil.pg_advisory_lock(bigint) RETURNS void LANGUAGE sql AS 'SELECT evil.boom(); SELECT';
CREATE FUNCTION evil.pg_advisory_xact_lock(bigint) RETURNS void LANGUAGE sql AS 'SELECT evil.boom(); SELECT';
CREATE FUNCTION evil.now() RETURNS timestamptz LANGUAGE sql AS 'SELECT evil.boom()::timestamptz';
CREATE FUNCTION evil.clock_timestamp() RETURNS timestamptz LANGUAGE sql AS 'SELECT evil.boom()::timestamptz';
CREATE FUNCTION evil.pg_backend_pid() RETURNS integer LANGUAGE sql AS 'SELECT evil.boom()::integer';
CREATE FUNCTION evil.format(text, text, text) RETURNS text LANGUAGE sql AS 'SELECT evil.boom()';
CREATE FUNCTION evil.format_type(oid, integer) RETURNS text LANGUAGE sql AS 'SELECT evil.boom()';
CREATE FUNCTION evil.length(text) RETURNS integer LANGUAGE sql AS 'SELECT evil.boom()::integer';
CREATE FUNCTION evil.lower(text) RETURNS text LANGUAGE sql AS 'SELECT evil.boom()';
CREATE FUNCTION evil.left(text, integer) RETURNS text LANGUAGE sql AS 'SELECT evil.boom()';
CREATE FUNCTION evil.right(text, integer) RETURNS text LANGUAGE sql AS 'SELECT evil.boom()';
CREATE FUNCTION evil.starts_with(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT evil.boom() IS NULL';
CREATE FUNCTION evil.eq_text(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT evil.boom() IS NULL';
CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.eq_text);
CREATE FUNCTION evil.eq_int8(bigint, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT evil.boom() IS NULL';
CREATE OPERATOR evil.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = evil.eq_int8);
CREATE OPERATOR evil.< (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = evil.eq_int8);
CREATE OPERATOR evil.> (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = evil.eq_int8);
CREATE FUNCTION evil.shr(bigint, integer) RETURNS bigint LANGUAGE sql AS 'SELECT evil.boom()::bigint';
CREATE OPERATOR evil.>> (LEFTARG = bigint, RIGHTARG = integer, FUNCTION = evil.shr);
CREATE FUNCTION evil.eq_name(name, name) RETURNS boolean LANGUAGE sql AS 'SELECT evil.boom() IS NULL';
CREATE OPERATOR evil.= (LEFTARG = name, RIGHTARG = name, FUNCTION = evil.eq_name);
CREATE FUNCTION evil.eq_oid(oid, oid) RETURNS boolean LANGUAGE sql AS 'SELECT evil.boom() IS NULL';
CREATE OPERATOR evil.= (LEFTARG = oid, RIGHTARG = oid, FUNCTION = evil.eq_oid);
GRANT USAGE ON SCHEMA evil TO PUBLIC;
";

/// A command's environment.
type Env<'a> = &'a [(&'a str, &'a str)];

#[tokio::test]
async fn every_command_with_a_hostile_schema_first_on_the_search_path() {
    let db = TestDb::empty().await;
    db.exec("CREATE TABLE public.acct (id int PRIMARY KEY, balance int NOT NULL)")
        .await;
    db.exec(EVIL).await;
    let app = Role::create(&db, "evil_app", "").await;
    let path = "evil, pg_catalog, public";
    db.exec(&format!(
        "ALTER DATABASE \"{}\" SET search_path = {path}; ALTER ROLE postgres IN DATABASE \"{}\" SET search_path = {path}",
        db.name, db.name
    ))
    .await;
    // The trap works: an unqualified call from a new session on this database is hijacked.
    let mut probe = PgConnection::connect(&db.url()).await.unwrap();
    let err = sqlx::raw_sql("SELECT now()")
        .execute(&mut probe)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("hijacked"), "{err}");
    probe.close().await.ok();

    let url = db.url();
    let redis = redis_url().await;
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("REDIS_URL", redis.as_str()),
    ];
    let r = unique_resource("evil").as_str().to_owned();
    let pg_issuer = [
        ("DATABASE_URL", url.as_str()),
        ("PGFENCE_ISSUER_URL", url.as_str()),
    ];
    let commands: Vec<(Env, Vec<&str>)> = vec![
        (&env, vec!["migrate"]),
        (&env, vec!["migrate", "--status"]),
        (&env, vec!["guard", "acct", "--lock-timeout", "2s"]),
        (&env, vec!["guard", "acct", "--observe"]),
        (&env, vec!["guard", "acct"]),
        (&env, vec!["tables"]),
        (&env, vec!["grant", &app.name]),
        (&env, vec!["audit"]),
        (&env, vec!["audit", "--follow", "--limit", "1"]),
        (&env, vec!["audit", "prune", "--older-than", "1d"]),
        (&env, vec!["doctor", "--no-redis"]),
        (&env, vec!["doctor", "--resource", &r]),
        (&env, vec!["reseed", &r]),
        (&env, vec!["lock", "status", &r]),
        (
            &env,
            vec!["run", "--resource", &r, "--ttl", "5s", "--", "true"],
        ),
        (&pg_issuer, vec!["lock", "status", &r]),
        (
            &pg_issuer,
            vec![
                "run",
                "--resource",
                &r,
                "--ttl",
                "5s",
                "--",
                "sh",
                "-ec",
                "pgfence effect begin --work w1 --step charge && pgfence effect finish --work w1 --step charge --outcome '{}'",
            ],
        ),
        (
            &pg_issuer,
            vec!["effect", "status", &r, "--work", "w1", "--step", "charge"],
        ),
        (&env, vec!["unguard", "acct"]),
    ];
    let bin_dir = std::path::Path::new(&bin()).parent().unwrap().to_owned();
    let path_env = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for (env, args) in commands {
        let mut env = env.to_vec();
        env.push(("PATH", &path_env));
        let out = if args.contains(&"--follow") {
            // --follow runs until stopped: two polls, then a kill.
            let mut child = Command::new(bin())
                .args(&args)
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            std::thread::sleep(std::time::Duration::from_millis(1500));
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            let err = text(&out.stderr);
            assert!(!err.contains("hijacked"), "{args:?}: {err}");
            continue;
        } else {
            run(&env, &args)
        };
        let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
        assert!(!all.contains("hijacked"), "{args:?} ran evil's code: {all}");
        assert!(out.status.success(), "{args:?}: {all}");
    }
    // The hostile path was in force for the CLI's sessions all along.
    let mut conn = PgConnection::connect(&db.url()).await.unwrap();
    let row = sqlx::raw_sql("SELECT pg_catalog.current_setting('search_path')")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(row.get::<String, _>(0), path);
    let _ = AssertSqlSafe("");
}

#[tokio::test]
async fn issuer_urls_one_parser_and_no_secret_echoed() {
    let db = TestDb::new().await;
    let url = db.url();
    let r = unique_resource("url").as_str().to_owned();
    // A Sentinel URL goes to the Sentinel client for every command that takes one (here:
    // nothing listens, so each says it cannot connect to Redis through Sentinel — never
    // "did not parse").
    let sentinel = "redis+sentinel://:s3cret-pw@127.0.0.1:1/mymaster";
    for args in [
        vec!["lock", "acquire", r.as_str(), "--ttl", "5s"],
        vec!["run", "--resource", r.as_str(), "--ttl", "5s", "--", "true"],
        vec!["lock", "status", r.as_str()],
        vec!["reseed", r.as_str()],
    ] {
        let out = run(
            &[("DATABASE_URL", &url), ("PGFENCE_ISSUER_URL", sentinel)],
            &args,
        );
        let err = fails(&out, &format!("{args:?} with no Sentinel"));
        assert!(!err.contains("did not parse"), "{args:?}: {err}");
        assert!(!err.contains("InvalidClientConfig"), "{args:?}: {err}");
        assert!(
            !err.contains("s3cret-pw"),
            "{args:?} echoed the password: {err}"
        );
    }
    // A URL without a scheme, with a password: refused without echoing it.
    for bad in [":hunter2@127.0.0.1:6379", "user:hunter2@127.0.0.1:6379/0"] {
        let out = run(
            &[("DATABASE_URL", &url), ("PGFENCE_ISSUER_URL", bad)],
            &["lock", "acquire", &r, "--ttl", "5s"],
        );
        let err = fails(&out, "scheme-less issuer URL");
        assert!(err.contains("no scheme"), "{err}");
        assert!(!err.contains("hunter2"), "echoed the password: {err}");
    }
    // Not a Redis URL: not called Redis.
    let out = run(
        &[
            ("DATABASE_URL", &url),
            ("PGFENCE_ISSUER_URL", "mysql://u:hunter2@h/db"),
        ],
        &["lock", "acquire", &r, "--ttl", "5s"],
    );
    let err = fails(&out, "unknown scheme");
    assert!(!err.contains("Redis"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
    // ZooKeeper over TLS: the library's own refusal reaches the user, not "unknown scheme".
    let out = run(
        &[
            ("DATABASE_URL", &url),
            ("PGFENCE_ISSUER_URL", "zks://127.0.0.1:1"),
        ],
        &["lock", "status", &r],
    );
    let err = fails(&out, "zks://");
    assert!(err.contains("TLS tunnel"), "{err}");
    // A keyword conninfo with a password that cannot connect: the password is hidden.
    let out = run(
        &[(
            "DATABASE_URL",
            "host=127.0.0.1 port=1 user=u password=hunter2 dbname=x",
        )],
        &["tables"],
    );
    let err = fails(&out, "unreachable conninfo");
    assert!(err.contains("cannot connect to PostgreSQL"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
    // An unknown conninfo keyword is refused by name.
    let out = run(
        &[("DATABASE_URL", "host=127.0.0.1 service=prod")],
        &["tables"],
    );
    let err = fails(&out, "unsupported conninfo keyword");
    assert!(err.contains("\"service\""), "{err}");
}
