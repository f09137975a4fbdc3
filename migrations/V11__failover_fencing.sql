-- V11: fences that survive the protected database's own failover.
--
-- A PostgreSQL promotion with asynchronous replication can lose commits the old primary had
-- acknowledged: rows and high-water marks go back to what the standby had replayed, so a
-- lease that a newer lease had fenced out finds "its own" fence again and would be let back
-- in. Every promotion starts a new timeline (visible to any role through the WAL file name),
-- so pgfence binds each lease to the timeline its first fenced statement ran on, and every
-- fenced statement presents that binding: one that meets another timeline is refused (PF009)
-- whatever the rows say. Leases whose first statement runs on the new timeline write as
-- usual. A binding of 0 means "not bound" (0.2 callers, the shell functions' older forms):
-- such a statement is not checked.
--
-- * pgfence.timeline(): the database's current timeline. A plain SQL expression, inlined
--   into the repository's statements (one WAL-position read, well under a microsecond).
-- * pgfence.timeline_history: every timeline pgfence has seen, when, and whether an operator
--   acknowledged it; `pgfence doctor` reports an unacknowledged one (a failover).
-- * pgfence.note_timeline(): records the current timeline (the library calls it once per
--   repository / fence handle, and again after a refusal); the first call on a new timeline
--   logs a WARNING.
-- * pgfence.require_timeline(), and timeline-taking forms of check, try_check and admits.
-- * pgfence.append_audit(..., reason): the audit row of a failover refusal says why.
-- * pgfence.acknowledge_failover(by): the owner marks the failover as handled.
--
-- Every statement is idempotent (CREATE OR REPLACE, IF NOT EXISTS), so the migration applies
-- again over itself, like V10.

CREATE OR REPLACE FUNCTION pgfence.timeline() RETURNS bigint
LANGUAGE sql
VOLATILE PARALLEL SAFE
AS $$
    SELECT (('x' OPERATOR(pg_catalog.||) pg_catalog.substr(
                pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))
            ::pg_catalog.bit(32))::pg_catalog.int4::pg_catalog.int8
$$;

CREATE TABLE IF NOT EXISTS pgfence.timeline_history (
    timeline        bigint      PRIMARY KEY,
    first_seen      timestamptz NOT NULL DEFAULT now(),
    acknowledged_at timestamptz,
    acknowledged_by text
);

-- The timeline pgfence is installed on is known and needs no acknowledgement.
INSERT INTO pgfence.timeline_history (timeline, acknowledged_at, acknowledged_by)
VALUES (pgfence.timeline(), now(), 'installed')
ON CONFLICT (timeline) DO NOTHING;

CREATE OR REPLACE FUNCTION pgfence.note_timeline(OUT current_timeline bigint, OUT previous_timeline bigint,
                                      OUT is_new boolean, OUT unacknowledged boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    current_timeline := pgfence.timeline();
    SELECT max(h.timeline) INTO previous_timeline
      FROM pgfence.timeline_history h WHERE h.timeline <> current_timeline;
    -- Written only when missing: the common call is a read, and never waits on another
    -- transaction that recorded the same timeline.
    is_new := false;
    IF NOT EXISTS (SELECT 1 FROM pgfence.timeline_history h WHERE h.timeline = current_timeline) THEN
        INSERT INTO pgfence.timeline_history (timeline) VALUES (current_timeline)
            ON CONFLICT (timeline) DO NOTHING;
        is_new := FOUND;
    END IF;
    IF is_new AND previous_timeline IS NOT NULL THEN
        RAISE WARNING 'pgfence: PostgreSQL failover: this database is on timeline % (pgfence last saw timeline %): every lease that wrote before the promotion is fenced out',
                current_timeline, previous_timeline
            USING DETAIL = format('timeline=%s previous=%s', current_timeline, previous_timeline),
                  HINT = 'check what the promotion lost, then acknowledge it: pgfence doctor --ack-failover';
    END IF;
    unacknowledged := EXISTS (SELECT 1 FROM pgfence.timeline_history h
                               WHERE h.acknowledged_at IS NULL);
END
$$;

-- Refuses (PF009) a lease bound to another timeline than the database's; returns the
-- database's timeline. p_target is `resource=<name>` or `table=<quoted table>`.
CREATE OR REPLACE FUNCTION pgfence.require_timeline(p_timeline bigint, p_token bigint, p_target text)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now bigint := pgfence.timeline();
BEGIN
    IF coalesce(p_timeline, 0) <> 0 AND p_timeline <> v_now THEN
        RAISE EXCEPTION 'pgfence: lease % fenced out on % by a database failover: it first wrote on timeline %, the database is on timeline %',
                p_token, regexp_replace(p_target, '^[a-z]+=', ''), p_timeline, v_now
            USING ERRCODE = 'PF009',
                  DETAIL = format('presented=%s lease_timeline=%s timeline=%s %s', p_token,
                                  p_timeline, v_now, p_target),
                  HINT = 'take a new lease: leases acquired after the promotion write as usual';
    END IF;
    RETURN v_now;
END
$$;

CREATE OR REPLACE FUNCTION pgfence.check(p_resource text, p_token bigint, p_tag integer, p_timeline bigint)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pgfence.require_timeline(p_timeline, p_token, 'resource=' || coalesce(p_resource, ''));
    PERFORM pgfence.check(p_resource, p_token, p_tag);
END
$$;

-- The library's form of check/4: instead of raising PF009 (which would abort the caller's
-- transaction), a lease bound to another timeline is not checked at all and the database's
-- timeline is returned for the library to decide (refuse, or bind a lease whose only
-- statement this was). Returns the database's timeline; raises what check raises.
CREATE OR REPLACE FUNCTION pgfence.check_on(p_resource text, p_token bigint, p_tag integer, p_timeline bigint)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now bigint := pgfence.timeline();
BEGIN
    IF coalesce(p_timeline, 0) = 0 OR p_timeline = v_now THEN
        PERFORM pgfence.check(p_resource, p_token, p_tag);
    END IF;
    RETURN v_now;
END
$$;

CREATE OR REPLACE FUNCTION pgfence.append_audit(
    p_resource text,
    p_table text,
    p_key text,
    p_presented bigint,
    p_current bigint,
    p_holder text,
    p_operation text,
    p_other_counter boolean,
    p_reason text
) RETURNS void
LANGUAGE sql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO pgfence.audit (resource, table_name, row_key, presented, current, holder, operation,
                               other_counter, reason)
    VALUES (p_resource, p_table, p_key, p_presented, p_current, p_holder, p_operation,
            coalesce(p_other_counter, false), p_reason)
$$;

-- The shell path's timeline forms: a failover refusal is audited, warned and remembered for
-- pgfence.stop_unless like every other rejection of try_check and admits.
CREATE OR REPLACE FUNCTION pgfence.failover_refusal(p_timeline bigint, p_token bigint, p_resource text,
                                         p_table text, p_key text, p_operation text)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now bigint := pgfence.timeline();
    v_message text;
    v_what text := coalesce(p_table || ' row ' || coalesce(p_key, '?'), p_resource, '?');
BEGIN
    IF coalesce(p_timeline, 0) = 0 OR p_timeline = v_now THEN
        RETURN false;
    END IF;
    v_message := format('lease %s fenced out on %s by a database failover: it first wrote on timeline %s, the database is on timeline %s',
                        p_token, v_what, p_timeline, v_now);
    PERFORM pgfence.append_audit(p_resource, p_table, p_key, p_token, NULL, current_user::text,
                                 p_operation, false,
                                 format('failover: lease timeline %s, database timeline %s',
                                        p_timeline, v_now));
    PERFORM set_config('pgfence.rejected', v_message, false);
    RAISE WARNING 'pgfence: % (recorded in pgfence.audit)', v_message
        USING DETAIL = format('presented=%s lease_timeline=%s timeline=%s %s', p_token, p_timeline,
                              v_now, CASE WHEN p_table IS NULL THEN 'resource=' || p_resource
                                          ELSE 'table=' || p_table END);
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION pgfence.try_check(p_resource text, p_token bigint, p_tag integer, p_timeline bigint)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF pgfence.failover_refusal(p_timeline, p_token, p_resource, NULL, NULL, 'check') THEN
        RETURN false;
    END IF;
    RETURN pgfence.try_check(p_resource, p_token, p_tag);
END
$$;

CREATE OR REPLACE FUNCTION pgfence.admits(p_current bigint, p_token bigint, p_tag integer, p_table regclass,
                               p_key text, p_timeline bigint)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_table text;
BEGIN
    SELECT pgfence.quoted_table(n.nspname, c.relname) INTO v_table
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = p_table;
    IF pgfence.failover_refusal(p_timeline, p_token, NULL, v_table, p_key, 'update') THEN
        RETURN false;
    END IF;
    RETURN pgfence.admits(p_current, p_token, p_tag, p_table, p_key);
END
$$;

-- The owner marks every unacknowledged timeline as handled (doctor stops reporting it).
-- Returns how many it acknowledged.
CREATE OR REPLACE FUNCTION pgfence.acknowledge_failover(p_by text) RETURNS integer
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n integer;
BEGIN
    PERFORM pgfence.note_timeline();
    UPDATE pgfence.timeline_history
       SET acknowledged_at = now(), acknowledged_by = coalesce(p_by, session_user::text)
     WHERE acknowledged_at IS NULL;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- Deny by default (V5), then: the current timeline is a fact any role may read (the
-- repository's statements inline it); the application's functions go to every role that
-- may already run pgfence.check (pgfence grant gives new roles the same list).
REVOKE ALL ON FUNCTION pgfence.timeline(), pgfence.note_timeline(),
    pgfence.require_timeline(bigint, bigint, text), pgfence.check(text, bigint, integer, bigint),
    pgfence.check_on(text, bigint, integer, bigint),
    pgfence.append_audit(text, text, text, bigint, bigint, text, text, boolean, text),
    pgfence.failover_refusal(bigint, bigint, text, text, text, text),
    pgfence.try_check(text, bigint, integer, bigint),
    pgfence.admits(bigint, bigint, integer, regclass, text, bigint),
    pgfence.acknowledge_failover(text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.timeline() TO PUBLIC;
DO $$
DECLARE
    v text;
BEGIN
    FOR v IN SELECT DISTINCT r.rolname
               FROM pg_proc p, aclexplode(p.proacl) a, pg_roles r
              WHERE p.oid = 'pgfence.check(text, bigint, integer)'::regprocedure
                AND a.privilege_type = 'EXECUTE' AND a.grantee = r.oid
                AND r.rolname <> current_user
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION pgfence.note_timeline(), '
                       'pgfence.require_timeline(bigint, bigint, text), '
                       'pgfence.check(text, bigint, integer, bigint), '
                       'pgfence.check_on(text, bigint, integer, bigint), '
                       'pgfence.append_audit(text, text, text, bigint, bigint, text, text, boolean, text), '
                       'pgfence.failover_refusal(bigint, bigint, text, text, text, text), '
                       'pgfence.try_check(text, bigint, integer, bigint), '
                       'pgfence.admits(bigint, bigint, integer, regclass, text, bigint) TO %I', v);
    END LOOP;
END
$$;
