-- pgfence 0.3: everything 0.3 adds to or changes in the 0.2.0 schema (V1..V6), in one migration.
--
-- What a 0.2.0 database runs next, and what an empty database runs after V1..V6. Sections:
--
--   1. The fence layout: SQL helpers that spell it once (pgfence::token::StoredFence in Rust).
--   2. The poisoning bound: how far above a mark's or row's token a presented token may be.
--   3. A lease's fence on a row: lease_fence and next_fence (the sequence cycle, sealed rows).
--   4. The audit trail: one spelling of table names, audit rows with a reason.
--   5. The check: resource marks (check, check_on, try_check, high-water marks, unpoison).
--   6. Timelines: fences that survive the protected database's own failover.
--   7. The shell path: admits, stop_unless and the audited failover refusal for psql scripts.
--   8. The guard: the bypass, the guard trigger function, its WHEN clause and installation.
--   9. The PostgreSQL issuer (pgfence::issuer::PgIssuer): leases and token counters.
--  10. The effect ledger (pgfence::Effects): idempotency keys for side effects.
--  11. schema_version(): which migrations are applied, readable by any role.
--  12. Upgrading a 0.2.0 database in place: stored data, installed guard triggers, grants.
--  13. The public surface: the functions only pgfence's own SQL calls are the owner's alone.
--  14. Statements whose client went away stop: client_connection_check_interval.
--
-- Privileges are deny by default (V5): each section revokes PUBLIC's EXECUTE on what it creates
-- and grants only what every role may run; what applications call is granted by
-- pgfence::admin::grant_sql. The functions users and the library call are the public surface
-- (docs/sql.md, "Functions", lists each); the rest are internal (section 13).
--
-- Every statement is idempotent (CREATE OR REPLACE, IF NOT EXISTS, guarded DO blocks), so the
-- migration applies again over itself (an owner repairing a history row) and keeps what an
-- owner set (the poisoning bound, grants).
--
-- Until 0.3 is released this file is edited in place; from the release on it is frozen and a
-- change is a new migration (docs/design.md, "Migrations").

------------------------------------------------------------------------------------------------
-- 1. The fence layout
--
-- A stored fence is token << 24 | counter << 20 | holder << 12 | sequence (docs/design.md,
-- "What a token means"). Only these helpers spell it; every function that reads or writes a
-- fence calls them, and tests compare each with StoredFence, value by value. They are
-- LANGUAGE sql IMMUTABLE with no SET clause and nothing a search_path could resolve (operators
-- are OPERATOR(pg_catalog.*), `bigint` is a keyword): the planner inlines them and folds calls
-- on constants, so a helper in a statement costs what its literal would.
--
-- They are internal (section 13): only the schema's owner executes them, so only pgfence's own
-- functions (SECURITY DEFINER where an application role calls them) use them. Executable by
-- every role, `SET fence = pgfence.next_step(fence)` would let any writer pass the guard as the
-- lease that last wrote the row.
------------------------------------------------------------------------------------------------

-- Where the token starts in a fence: fence = token << 24 | tag << 12 | sequence.
CREATE OR REPLACE FUNCTION pgfence.token_shift() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 24 $$;

-- Where the 12-bit tag (counter << 8 | holder) starts: above the 12-bit sequence.
CREATE OR REPLACE FUNCTION pgfence.tag_shift() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 12 $$;

-- The largest tag (12 bits).
CREATE OR REPLACE FUNCTION pgfence.max_tag() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 4095 $$;

-- The sequence of a sealed fence (every sequence bit set), and the modulus of a lease's
-- sequence cycle 0..4094.
CREATE OR REPLACE FUNCTION pgfence.sealed_sequence() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 4095::bigint $$;

-- The step of a lease's sequence cycle: next = (sequence + step) mod 4095.
CREATE OR REPLACE FUNCTION pgfence.sequence_step() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 2731::bigint $$;

-- The token of a fence (0 for a fence no lease wrote).
CREATE OR REPLACE FUNCTION pgfence.fence_token(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_fence OPERATOR(pg_catalog.>>) pgfence.token_shift() $$;

-- The largest token: the token of the largest bigint (549755813887, 2^39 - 1).
CREATE OR REPLACE FUNCTION pgfence.max_token() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pgfence.fence_token(9223372036854775807::bigint) $$;

-- The lowest fence of a token (tag and sequence 0): every fence below it is an older lease's.
CREATE OR REPLACE FUNCTION pgfence.token_fence(p_token bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_token OPERATOR(pg_catalog.<<) pgfence.token_shift() $$;

-- The 4-bit hash of the counter a fence's token came from (the tag's high 4 bits).
CREATE OR REPLACE FUNCTION pgfence.fence_counter(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT (p_fence OPERATOR(pg_catalog.>>) (pgfence.tag_shift() OPERATOR(pg_catalog.+) 8))
           OPERATOR(pg_catalog.&) 15::bigint
$$;

-- The 8-bit hash of a fence's holder (the tag's low 8 bits).
CREATE OR REPLACE FUNCTION pgfence.fence_holder(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT (p_fence OPERATOR(pg_catalog.>>) pgfence.tag_shift()) OPERATOR(pg_catalog.&) 255::bigint
$$;

-- A fence's sequence: 0..4094 on its lease's cycle, 4095 sealed.
CREATE OR REPLACE FUNCTION pgfence.fence_sequence(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_fence OPERATOR(pg_catalog.&) pgfence.sealed_sequence() $$;

-- The lease fence a fence belongs to: its token and tag, sequence 0.
CREATE OR REPLACE FUNCTION pgfence.fence_lease(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_fence OPERATOR(pg_catalog.&) (OPERATOR(pg_catalog.~) pgfence.sealed_sequence()) $$;

-- The same fence sealed: changed outside the fencing protocol after its lease wrote it.
CREATE OR REPLACE FUNCTION pgfence.sealed_fence(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT p_fence OPERATOR(pg_catalog.|) pgfence.sealed_sequence() $$;

-- What the same lease's next write stores over a fence: the next step of its sequence
-- cycle; NULL for a sealed fence (that lease may not write it again).
CREATE OR REPLACE FUNCTION pgfence.next_step(p_fence bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN pgfence.fence_sequence(p_fence) OPERATOR(pg_catalog.=) pgfence.sealed_sequence()
                THEN NULL
                ELSE pgfence.fence_lease(p_fence) OPERATOR(pg_catalog.+)
                     ((pgfence.fence_sequence(p_fence) OPERATOR(pg_catalog.+) pgfence.sequence_step())
                      OPERATOR(pg_catalog.%) pgfence.sealed_sequence()) END
$$;

-- Whether a fence a lease wrote (token above 0) came from another counter than p_lease's:
-- tokens of two counters do not compare.
CREATE OR REPLACE FUNCTION pgfence.other_counter(p_fence bigint, p_lease bigint) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT pgfence.fence_token(p_fence) OPERATOR(pg_catalog.>) 0
       AND pgfence.fence_counter(p_fence) OPERATOR(pg_catalog.<>) pgfence.fence_counter(p_lease)
$$;

-- The 12-bit tag of a fence (counter << 8 | holder): what a hand-written write's fence
-- (Lease::fence()) names, read by the guard.
CREATE OR REPLACE FUNCTION pgfence.fence_tag(p_fence bigint) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ((p_fence OPERATOR(pg_catalog.>>) pgfence.tag_shift())
            OPERATOR(pg_catalog.&) pgfence.max_tag())::integer
$$;

REVOKE ALL ON FUNCTION pgfence.token_shift(), pgfence.tag_shift(), pgfence.max_tag(),
    pgfence.sealed_sequence(), pgfence.sequence_step(), pgfence.fence_token(bigint),
    pgfence.max_token(), pgfence.token_fence(bigint), pgfence.fence_counter(bigint),
    pgfence.fence_holder(bigint), pgfence.fence_sequence(bigint), pgfence.fence_lease(bigint),
    pgfence.sealed_fence(bigint), pgfence.next_step(bigint), pgfence.other_counter(bigint, bigint),
    pgfence.fence_tag(bigint)
    FROM PUBLIC;

------------------------------------------------------------------------------------------------
-- 2. The poisoning bound
--
-- A token more than pgfence.max_token_jump() (2^36 unless the owner set another bound with
-- pgfence.set_max_token_jump) above the token a resource mark or a row already has is refused
-- with PF008 (audited where the refusal can be: try_check, admits, the library), instead of
-- locking every real lease out. A fresh mark or row (token 0) has no reference and is not
-- bounded.
------------------------------------------------------------------------------------------------

-- The bound. An IMMUTABLE SQL function with no SET clause, so the planner inlines it and folds
-- it to a constant (the guard trigger's WHEN clause costs a lease's write no function call);
-- its body names nothing a search_path could resolve (`bigint` is a keyword for
-- pg_catalog.int8). set_max_token_jump replaces the function, which invalidates cached plans
-- that used it. (Created only when missing: applying the migration again keeps a bound the
-- owner set.)
DO $do$
BEGIN
    IF to_regprocedure('pgfence.max_token_jump()') IS NULL THEN
        CREATE FUNCTION pgfence.max_token_jump() RETURNS bigint
        LANGUAGE sql IMMUTABLE PARALLEL SAFE
        AS $$ SELECT 68719476736::bigint $$;
    END IF;
END
$do$;

-- Owner-only: sets the bound (1 .. the largest token). Returns the previous one.
CREATE OR REPLACE FUNCTION pgfence.set_max_token_jump(p_jump bigint) RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_old bigint := pgfence.max_token_jump();
BEGIN
    IF p_jump IS NULL OR p_jump < 1 OR p_jump > pgfence.max_token() THEN
        RAISE EXCEPTION 'pgfence: the token jump bound is 1 to %, got %', pgfence.max_token(), p_jump
            USING ERRCODE = '22023';
    END IF;
    EXECUTE format('CREATE OR REPLACE FUNCTION pgfence.max_token_jump() RETURNS bigint '
                   'LANGUAGE sql IMMUTABLE PARALLEL SAFE '
                   'AS $f$ SELECT %s::bigint $f$', p_jump);
    -- The guard triggers' WHEN clauses carry the bound: re-install them, in their modes.
    PERFORM pgfence.install_guard_trigger(t.tgrelid::regclass, pgfence.trigger_mode(t.tgnargs, t.tgargs))
       FROM pg_trigger t
      WHERE t.tgname = 'pgfence_guard' AND NOT t.tgisinternal;
    RETURN v_old;
END
$$;

-- Raises PF008 when p_token is more than the bound above p_current_token (> 0).
CREATE OR REPLACE FUNCTION pgfence.refuse_token_jump(p_current_token bigint, p_token bigint, p_target text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF coalesce(p_current_token, 0) > 0 AND p_token - p_current_token > pgfence.max_token_jump() THEN
        RAISE EXCEPTION 'pgfence: token % refused on %: more than % above its current token % (a token that far ahead would lock every real lease out; pgfence.max_token_jump)',
                p_token, p_target, pgfence.max_token_jump(), p_current_token
            USING ERRCODE = 'PF008',
                  DETAIL = format('presented=%s current=%s max_jump=%s %s', p_token,
                                  p_current_token, pgfence.max_token_jump(), p_target),
                  HINT = 'a forged or corrupted token: find who presented it (pgfence audit); the owner can raise the bound with pgfence.set_max_token_jump';
    END IF;
END
$$;

REVOKE ALL ON FUNCTION pgfence.set_max_token_jump(bigint),
    pgfence.refuse_token_jump(bigint, bigint, text)
    FROM PUBLIC;
-- The bound is a number anyone may read. refuse_token_jump is internal: the functions that
-- write a fence call it with their owner's rights.
GRANT EXECUTE ON FUNCTION pgfence.max_token_jump() TO PUBLIC;

------------------------------------------------------------------------------------------------
-- 3. A lease's fence on a row
--
-- A lease's first write to a row stores its lease fence (sequence 0). Each later write by the
-- same lease steps the sequence through a fixed cycle of the 4,095 values 0..4094
-- (next = (sequence + 2731) mod 4095), so one lease writes one row any number of times.
-- Sequence 4095 is a sealed fence: the row was changed outside the fencing protocol (an
-- audited bypass, or a write let through in observe mode) after the lease that wrote it, and
-- that lease's next write is rejected (PF005). Fences written by 0.2 stay valid as they are:
-- sequences 0..4094 continue on the cycle, and 4095 is sealed.
------------------------------------------------------------------------------------------------

-- The lease fence of a token and tag: what the lease's first write to a row stores.
CREATE OR REPLACE FUNCTION pgfence.lease_fence(p_token bigint, p_tag integer) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_token IS NULL OR p_token < 1 OR p_token > pgfence.max_token() THEN
        RAISE EXCEPTION 'pgfence: fence tokens are 1 to %, got %', pgfence.max_token(), p_token
            USING ERRCODE = '22023';
    END IF;
    IF p_tag IS NULL OR p_tag < 0 OR p_tag > pgfence.max_tag() THEN
        RAISE EXCEPTION 'pgfence: lease tags are 0 to %, got %', pgfence.max_tag(), p_tag USING ERRCODE = '22023';
    END IF;
    RETURN pgfence.token_fence(p_token) | (p_tag::bigint << pgfence.tag_shift());
END
$$;

-- The fence a lease's write to a row stores, given the row's current fence: for SQL callers
-- (psql under `pgfence run`), as `SET ..., fence = pgfence.next_fence(fence, :token, :tag)`.
-- Raises PF001 when a newer lease wrote the row (DETAIL says origin=other when its token came
-- from another counter), PF004 when another lease presented the same token from the same
-- counter (the counter went backwards), PF005 when the row was sealed (changed outside the
-- protocol) after this lease wrote it. p_table only names the table in the error.
-- lease_fence and next_fence run with their owner's rights: they read the layout's helpers,
-- which no application role may execute (section 13).
CREATE OR REPLACE FUNCTION pgfence.next_fence(p_current bigint, p_token bigint, p_tag integer DEFAULT 0,
                                              p_table text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    lease bigint := pgfence.lease_fence(p_token, p_tag);
    cur bigint := coalesce(p_current, 0);
    other_counter boolean := pgfence.other_counter(cur, lease);
    code text;
BEGIN
    PERFORM pgfence.refuse_token_jump(pgfence.fence_token(cur), p_token, 'table=' || coalesce(p_table, '?'));
    IF cur < pgfence.token_fence(p_token) THEN
        RETURN lease;
    ELSIF pgfence.fence_lease(cur) = lease AND cur <> pgfence.sealed_fence(cur) THEN
        RETURN pgfence.next_step(cur);
    ELSIF cur = pgfence.sealed_fence(lease) THEN
        code := 'PF005';
    ELSIF pgfence.fence_token(cur) = p_token AND NOT other_counter THEN
        code := 'PF004';
    ELSE
        code := 'PF001';
    END IF;
    RAISE EXCEPTION 'pgfence: % on %: presented token %, current token %',
            CASE code WHEN 'PF001' THEN 'stale fence token'
                      WHEN 'PF004' THEN 'duplicate fence token (the counter went backwards; reseed it)'
                      ELSE 'row sealed: changed outside the fencing protocol after this lease wrote it (take a new lease and re-read)' END,
            coalesce(p_table, 'a row'), p_token, pgfence.fence_token(cur)
        USING ERRCODE = code,
              DETAIL = format('presented=%s current=%s %stable=%s', p_token, pgfence.fence_token(cur),
                              CASE WHEN other_counter THEN 'origin=other ' ELSE '' END,
                              coalesce(p_table, '?')),
              HINT = CASE code WHEN 'PF001' THEN 'a newer lease holds this row: this job must stop'
                               WHEN 'PF004' THEN 'reseed the counter (pgfence reseed) and take a new lease'
                               ELSE 'take a new lease and re-read the row' END;
END
$$;

------------------------------------------------------------------------------------------------
-- 4. The audit trail
------------------------------------------------------------------------------------------------

-- "schema"."table", always quoted: the one spelling of a table in pgfence.audit (the
-- library's TableName::quoted writes the same).
CREATE OR REPLACE FUNCTION pgfence.quoted_table(p_schema text, p_table text) RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT '"' || replace(p_schema, '"', '""') || '"."' || replace(p_table, '"', '""') || '"'
$$;

-- One audit row, with the reason a refusal has (a failover refusal says why).
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

REVOKE ALL ON FUNCTION pgfence.quoted_table(text, text) FROM PUBLIC;

-- The rejecting statement's own audit row names a duplicate token or a sealed row in its
-- `reason`, as the library's does (NULL for a plain stale rejection).
DROP FUNCTION IF EXISTS pgfence.record_rejection(text, text, text, bigint, bigint, text, text, integer, boolean);
CREATE OR REPLACE FUNCTION pgfence.record_rejection(
    p_resource text,
    p_table text,
    p_key text,
    p_presented bigint,
    p_current bigint,
    p_holder text,
    p_operation text,
    p_lock_timeout_ms integer,
    p_other_counter boolean,
    p_reason text
) RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Bounds the wait for the audit table. Local to the calling statement's transaction,
    -- which is that statement alone.
    PERFORM pg_catalog.set_config('lock_timeout', p_lock_timeout_ms::pg_catalog.text, true);
    PERFORM pgfence.append_audit(p_resource, p_table, p_key, p_presented, p_current, p_holder,
                                 p_operation, p_other_counter, p_reason);
    RETURN '';
END
$$;
REVOKE ALL ON FUNCTION
    pgfence.record_rejection(text, text, text, bigint, bigint, text, text, integer, boolean, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    pgfence.record_rejection(text, text, text, bigint, bigint, text, text, integer, boolean, text)
    TO PUBLIC;

------------------------------------------------------------------------------------------------
-- 5. The check: resource marks
------------------------------------------------------------------------------------------------

-- Records that the lease (token, tag) acted on p_resource: raises PF001 when a newer lease
-- already checked it, PF004 for the same token from the same counter, PF008 for a token too
-- far above the resource's mark (before anything is written).
CREATE OR REPLACE FUNCTION pgfence.check(p_resource text, p_token bigint, p_tag integer DEFAULT 0)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    lease bigint;
    cur bigint;
    other_counter boolean;
BEGIN
    IF p_token IS NULL OR p_token <= 0 THEN
        RAISE EXCEPTION 'pgfence: fence tokens are positive, got %', p_token USING ERRCODE = '22023';
    END IF;
    IF p_resource IS NULL OR length(p_resource) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'pgfence: resource names are 1 to 200 characters' USING ERRCODE = '22023';
    END IF;
    lease := pgfence.lease_fence(p_token, p_tag);
    SELECT r.fence INTO cur FROM pgfence.resource_fence r WHERE r.resource = p_resource;
    PERFORM pgfence.refuse_token_jump(pgfence.fence_token(cur), p_token, 'resource=' || p_resource);

    INSERT INTO pgfence.resource_fence AS r (resource, fence)
    VALUES (p_resource, lease)
    ON CONFLICT (resource) DO UPDATE
        SET fence = EXCLUDED.fence, updated_at = now()
        WHERE r.fence < pgfence.token_fence(p_token) OR r.fence = EXCLUDED.fence;
    IF FOUND THEN
        RETURN;
    END IF;

    -- ON CONFLICT left the row locked; read the mark that beat us.
    SELECT r.fence INTO cur FROM pgfence.resource_fence r WHERE r.resource = p_resource;
    other_counter := pgfence.other_counter(cur, lease);
    IF pgfence.fence_token(cur) = p_token AND NOT other_counter THEN
        RAISE EXCEPTION 'pgfence: duplicate fence token for resource %: token % was already presented by another lease (the counter went backwards; reseed it)',
                p_resource, p_token
            USING ERRCODE = 'PF004',
                  DETAIL = format('presented=%s current=%s resource=%s', p_token, p_token, p_resource);
    END IF;
    RAISE EXCEPTION 'pgfence: stale fence token for resource %: presented %, current %',
            p_resource, p_token, pgfence.fence_token(cur)
        USING ERRCODE = 'PF001',
              DETAIL = format('presented=%s current=%s %sresource=%s', p_token, pgfence.fence_token(cur),
                              CASE WHEN other_counter THEN 'origin=other ' ELSE '' END, p_resource);
END
$$;

-- The non-raising form for SQL callers: false (after an audit row, a WARNING, and the
-- rejection left for pgfence.stop_unless) instead of PF001 / PF004 / PF008. The shell path's
-- functions (try_check, admits) run with their owner's rights (they call internal functions);
-- the audit row's holder is the calling role as the guard trigger names it (the role set by
-- SET ROLE, else the session's).
CREATE OR REPLACE FUNCTION pgfence.try_check(p_resource text, p_token bigint, p_tag integer DEFAULT 0)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_state text;
    v_detail text;
    v_message text;
    v_current bigint;
BEGIN
    BEGIN
        PERFORM pgfence.check(p_resource, p_token, p_tag);
        RETURN true;
    EXCEPTION WHEN SQLSTATE 'PF001' OR SQLSTATE 'PF004' OR SQLSTATE 'PF008' THEN
        GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_detail = PG_EXCEPTION_DETAIL,
                                v_message = MESSAGE_TEXT;
    END;
    v_current := coalesce(substring(v_detail FROM 'current=([0-9]+)')::bigint, p_token);
    PERFORM pgfence.append_audit(p_resource, NULL, NULL, p_token, v_current,
                                 CASE WHEN current_setting('role') = 'none' THEN session_user::text
                                      ELSE current_setting('role') END,
                                 'check', v_state = 'PF001' AND strpos(v_detail, 'origin=other') > 0);
    v_message := regexp_replace(v_message, '^pgfence: ', '');
    PERFORM set_config('pgfence.rejected', v_message, false);
    RAISE WARNING 'pgfence: % (recorded in pgfence.audit)', v_message USING DETAIL = v_detail;
    RETURN false;
END
$$;

-- The newest token that checked p_resource (0 when none).
CREATE OR REPLACE FUNCTION pgfence.high_water(p_resource text) RETURNS bigint
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce((SELECT pgfence.fence_token(fence) FROM pgfence.resource_fence WHERE resource = p_resource), 0)
$$;

-- The newest token that checked any resource of fencing domain p_domain (0 when none).
CREATE OR REPLACE FUNCTION pgfence.domain_high_water(p_domain text) RETURNS bigint
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce(max(pgfence.fence_token(fence)), 0) FROM pgfence.resource_fence
     WHERE left(resource, length(p_domain) + 2) = '{' || p_domain || '}'
$$;

-- Which resource of fencing domain p_domain checked with token p_token: its mark carries the
-- token (tokens of one domain come from one counter, so at most one resource has it). For
-- a rejection's diagnosis only ("taken over by resource ..."); NULL when none.
CREATE OR REPLACE FUNCTION pgfence.domain_mark_holder(p_domain text, p_token bigint) RETURNS text
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT r.resource FROM pgfence.resource_fence r
     WHERE left(r.resource, length(p_domain) + 2) = '{' || p_domain || '}'
       AND pgfence.fence_token(r.fence) = p_token
     ORDER BY r.resource
     LIMIT 1
$$;

-- Owner-only: lowers a poisoned mark to p_to_token (0 deletes it), audited. Returns the old
-- token, NULL when the resource has no mark.
CREATE OR REPLACE FUNCTION pgfence.unpoison_resource(p_resource text, p_to_token bigint)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_old bigint;
BEGIN
    IF p_to_token IS NULL OR p_to_token < 0 OR p_to_token > pgfence.max_token() THEN
        RAISE EXCEPTION 'pgfence: fence tokens are 0 to %, got %', pgfence.max_token(), p_to_token
            USING ERRCODE = '22023';
    END IF;
    SELECT pgfence.fence_token(r.fence) INTO v_old FROM pgfence.resource_fence r
     WHERE r.resource = p_resource FOR UPDATE;
    IF v_old IS NULL THEN
        RETURN NULL;
    END IF;
    IF p_to_token > v_old THEN
        RAISE EXCEPTION 'pgfence: unpoison_resource only lowers marks: % holds token %, not above %',
                p_resource, v_old, p_to_token
            USING ERRCODE = '22023';
    END IF;
    IF p_to_token = 0 THEN
        DELETE FROM pgfence.resource_fence WHERE resource = p_resource;
    ELSE
        UPDATE pgfence.resource_fence SET fence = pgfence.token_fence(p_to_token + 1) - 1, updated_at = now()
         WHERE resource = p_resource;
    END IF;
    INSERT INTO pgfence.audit (resource, presented, current, holder, operation)
    VALUES (p_resource, p_to_token, v_old, current_user::text, 'unpoison');
    RETURN v_old;
END
$$;

-- A tombstone's fence never goes down (the trigger on pgfence.tombstone).
-- It fires for the application role's writes and reads the layout's helpers: owner's rights.
CREATE OR REPLACE FUNCTION pgfence.reject_lowered_tombstone() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'pgfence: a tombstone''s fence never goes down (presented token %, current token %)',
            pgfence.fence_token(NEW.fence), pgfence.fence_token(OLD.fence)
        USING ERRCODE = '42501',
              DETAIL = format('presented=%s current=%s table=pgfence.tombstone',
                              pgfence.fence_token(NEW.fence), pgfence.fence_token(OLD.fence)),
              HINT = 'the table owner can delete a tombstone',
              SCHEMA = 'pgfence',
              TABLE = 'tombstone',
              COLUMN = 'fence';
END
$$;

REVOKE ALL ON FUNCTION pgfence.try_check(text, bigint, integer),
    pgfence.domain_mark_holder(text, bigint)
    FROM PUBLIC;

------------------------------------------------------------------------------------------------
-- 6. Timelines: fences that survive the protected database's own failover
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
------------------------------------------------------------------------------------------------

-- The database's current timeline. A plain SQL expression, inlined into the repository's
-- statements (one WAL-position read, well under a microsecond).
CREATE OR REPLACE FUNCTION pgfence.timeline() RETURNS bigint
LANGUAGE sql
VOLATILE PARALLEL SAFE
AS $$
    SELECT (('x' OPERATOR(pg_catalog.||) pg_catalog.substr(
                pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))
            ::pg_catalog.bit(32))::pg_catalog.int4::pg_catalog.int8
$$;

-- Whether this database can tell its timeline, decided once (here, and again by
-- pgfence.configure_timeline()): every role's fenced statements read the WAL position
-- (pgfence.timeline() is inlined into them), so the WAL functions must work and be
-- executable by PUBLIC. Where they are not — Amazon Aurora without logical replication
-- ("WAL control functions cannot be executed when wal_level < logical"), a server that
-- revoked them — pgfence.timeline() is 0: leases are not bound to a timeline and failover
-- fencing by timeline is off for this database (doctor says so, and why); every other
-- protection is unchanged.
CREATE TABLE IF NOT EXISTS pgfence.timeline_check (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    enabled  boolean NOT NULL,
    reason   text
);

-- Decides whether the timeline check is on, defines pgfence.timeline() accordingly and
-- records the decision; returns it. The schema owner runs it again after the server's
-- settings changed (e.g. logical replication switched on).
CREATE OR REPLACE FUNCTION pgfence.configure_timeline() RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $cfg$
DECLARE
    v_reason text;
BEGIN
    SELECT string_agg(format('%s is not executable by PUBLIC', p.oid::regprocedure), '; ')
      INTO v_reason
      FROM pg_catalog.pg_proc p
     WHERE p.oid IN ('pg_catalog.pg_current_wal_lsn()'::regprocedure,
                     'pg_catalog.pg_walfile_name(pg_lsn)'::regprocedure)
       AND p.proacl IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM pg_catalog.aclexplode(p.proacl) a
                        WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE');
    IF v_reason IS NULL THEN
        BEGIN
            PERFORM pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn());
        EXCEPTION WHEN OTHERS THEN
            v_reason := format('the server refuses the WAL functions: %s', SQLERRM);
        END;
    END IF;
    IF v_reason IS NULL THEN
        CREATE OR REPLACE FUNCTION pgfence.timeline() RETURNS bigint
        LANGUAGE sql
        VOLATILE PARALLEL SAFE
        AS $$
    SELECT (('x' OPERATOR(pg_catalog.||) pg_catalog.substr(
                pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))
            ::pg_catalog.bit(32))::pg_catalog.int4::pg_catalog.int8
$$;
    ELSE
        CREATE OR REPLACE FUNCTION pgfence.timeline() RETURNS bigint
        LANGUAGE sql
        VOLATILE PARALLEL SAFE
        AS $$ SELECT 0::pg_catalog.int8 $$;
    END IF;
    INSERT INTO pgfence.timeline_check AS c (only_row, enabled, reason)
    VALUES (true, v_reason IS NULL, v_reason)
    ON CONFLICT (only_row) DO UPDATE SET enabled = EXCLUDED.enabled, reason = EXCLUDED.reason;
    RETURN v_reason IS NULL;
END
$cfg$;
REVOKE ALL ON FUNCTION pgfence.configure_timeline() FROM PUBLIC;
REVOKE ALL ON pgfence.timeline_check FROM PUBLIC;
SELECT pgfence.configure_timeline();

-- Every timeline pgfence has seen, when, and whether an operator acknowledged it; `pgfence
-- doctor` reports an unacknowledged one (a failover).
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

-- Records the current timeline (the library calls it once per repository / fence handle, and
-- again after a refusal); the first call on a new timeline logs a WARNING.
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

-- check with the lease's timeline: PF009 first, then what check raises.
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

------------------------------------------------------------------------------------------------
-- 7. The shell path: fenced writes from psql scripts under `pgfence run`
------------------------------------------------------------------------------------------------

-- The non-raising row-write predicate for SQL callers, for the WHERE clause of an UPDATE
-- (p_table is a regclass: 'accounts' resolves with the caller's search_path):
--   UPDATE accounts SET balance = balance + 100,
--          fence = pgfence.next_fence(fence, :token, :tag, 'accounts')
--    WHERE id = 14 AND pgfence.admits(fence, :token, :tag, 'accounts', '14');
-- True when the lease may write the row (next_fence will not raise). Otherwise (a newer lease,
-- a duplicate token, a sealed row) it appends one audit row (operation 'update', holder = the
-- calling role), raises a WARNING with the reason and returns false: the UPDATE changes
-- nothing and the statement succeeds, so the audit row commits with it (autocommit) and the
-- script tests ROW_COUNT to stop (README, "Shell jobs"). Invalid arguments raise 22023.
CREATE OR REPLACE FUNCTION pgfence.admits(p_current bigint, p_token bigint, p_tag integer, p_table regclass,
                               p_key text DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_table text;
    v_state text;
    v_detail text;
    v_message text;
BEGIN
    -- The table as the audit trail spells every table (the argument was resolved with the
    -- caller's search_path when it was cast to regclass).
    SELECT pgfence.quoted_table(n.nspname, c.relname) INTO v_table
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = p_table;
    BEGIN
        PERFORM pgfence.next_fence(p_current, p_token, p_tag, v_table);
        RETURN true;
    EXCEPTION WHEN SQLSTATE 'PF001' OR SQLSTATE 'PF004' OR SQLSTATE 'PF005' OR SQLSTATE 'PF008' THEN
        GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_detail = PG_EXCEPTION_DETAIL,
                                v_message = MESSAGE_TEXT;
    END;
    PERFORM pgfence.append_audit(NULL, v_table, p_key, p_token, pgfence.fence_token(coalesce(p_current, 0)),
                                 CASE WHEN current_setting('role') = 'none' THEN session_user::text
                                      ELSE current_setting('role') END,
                                 'update',
                                 strpos(v_detail, 'origin=other') > 0);
    v_message := regexp_replace(v_message, '^pgfence: ', '');
    -- Session level on purpose: the statement's own transaction commits the audit row, and
    -- pgfence.stop_unless in the script's next statement reports this rejection.
    PERFORM set_config('pgfence.rejected', format('%s (row %s)', v_message, coalesce(p_key, '?')), false);
    RAISE WARNING 'pgfence: % (row %; recorded in pgfence.audit)', v_message, coalesce(p_key, '?')
        USING DETAIL = v_detail;
    RETURN false;
END
$$;

-- Stops a psql script (ON_ERROR_STOP) when p_ok is not true, after a non-raising fenced
-- statement committed its audit row:
--   SELECT pgfence.try_check(:'resource', :token, :tag) AS held \gset
--   SELECT pgfence.stop_unless(:'held', :'resource');
--   UPDATE ... WHERE id = 42 AND pgfence.admits(fence, :token, :tag, 'accounts', '[42]');
--   SELECT pgfence.stop_unless(:ROW_COUNT = 1, 'accounts [42]');
-- Raises PF001 naming the rejection try_check / admits recorded in this session (and forgets
-- it), or P0002 (no_data_found) when there was none: the row does not exist. Stale and not
-- found are never confused.
CREATE OR REPLACE FUNCTION pgfence.stop_unless(p_ok boolean, p_what text DEFAULT NULL) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rejected text := nullif(current_setting('pgfence.rejected', true), '');
BEGIN
    IF p_ok THEN
        RETURN;
    END IF;
    IF v_rejected IS NOT NULL THEN
        PERFORM set_config('pgfence.rejected', '', false);
        RAISE EXCEPTION 'pgfence: stopping: % (recorded in pgfence.audit)', v_rejected
            USING ERRCODE = 'PF001', DETAIL = format('what=%s', coalesce(p_what, '?')),
                  HINT = 'a newer lease holds the work (or the row was sealed): this job must not go on';
    END IF;
    RAISE EXCEPTION 'pgfence: stopping: % was not written: no such row', coalesce(p_what, 'the row')
        USING ERRCODE = 'P0002';
END
$$;

-- The shell path's timeline forms: a failover refusal is audited, warned and remembered for
-- pgfence.stop_unless like every other rejection of try_check and admits.
CREATE OR REPLACE FUNCTION pgfence.failover_refusal(p_timeline bigint, p_token bigint, p_resource text,
                                         p_table text, p_key text, p_operation text)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
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
    PERFORM pgfence.append_audit(p_resource, p_table, p_key, p_token, NULL,
                                 CASE WHEN current_setting('role') = 'none' THEN session_user::text
                                      ELSE current_setting('role') END,
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
SECURITY DEFINER
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
SECURITY DEFINER
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

REVOKE ALL ON FUNCTION pgfence.admits(bigint, bigint, integer, regclass, text),
    pgfence.stop_unless(boolean, text)
    FROM PUBLIC;
-- The timeline functions the application calls go to every role that may run pgfence.check
-- (section 12; pgfence grant gives new roles the same list); the current timeline is a fact
-- any role may read (the repository's statements inline it).
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

------------------------------------------------------------------------------------------------
-- 8. The guard
--
-- The guard trigger lets an UPDATE through only when it is a lease's write: a newer token's
-- write (within the poisoning bound) or the fence's next step in its lease's cycle.
-- `fence = fence + 1`, `fence = fence + 100` or a copied fence that is neither is refused
-- with a message that points at `pgfence run` and `pgfence.bypass`; a copied fence of a newer
-- token fences out every lease that wrote the row before it. The bypass is bound to the
-- transaction that set it (pgfence.bypass(reason)); a refused bypass is PF006 with the role and
-- the reason.
------------------------------------------------------------------------------------------------

-- Starts an audited bypass of the guard for the calling transaction:
--   BEGIN; SELECT pgfence.bypass('refund #123'); UPDATE ...; COMMIT;
-- It sets pgfence.bypass (the reason) and pgfence.bypass_xact (this transaction's id), both
-- transaction-local. The guard trigger honours a reason only in the transaction whose id it
-- carries: a plain `SET pgfence.bypass` (session level, which would outlive its transaction
-- and bypass every later update on a pooled connection) bypasses nothing. Whether the role
-- may bypass is the trigger's decision (pgfence.allow_bypass), made per row.
CREATE OR REPLACE FUNCTION pgfence.bypass(p_reason text) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_reason IS NULL OR btrim(p_reason) = '' OR length(p_reason) > 500 THEN
        RAISE EXCEPTION 'pgfence: a bypass needs a reason of 1 to 500 characters'
            USING ERRCODE = '22023';
    END IF;
    PERFORM set_config('pgfence.bypass', p_reason, true);
    PERFORM set_config('pgfence.bypass_xact', txid_current()::text, true);
END
$$;

-- The guard trigger. Runs only for an UPDATE that is not a lease's write (the trigger's WHEN
-- clause). Enforcing (no argument): raises PF007 for a lease-less write that changed the
-- fence, PF001 for one that did not advance it, PF006 for a refused bypass, unless
-- pgfence.bypass(reason) was called in this transaction by a role that may bypass: then the
-- write goes through, audited, and the row is sealed. Observing ('observe'): lets the write
-- through, audited and sealed. Never builds SQL from values (see V6).
CREATE OR REPLACE FUNCTION pgfence.reject_stale_update() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_observe boolean := TG_NARGS > 0 AND TG_ARGV[0] = 'observe';
    v_reason text := nullif(btrim(current_setting('pgfence.bypass', true)), '');
    v_xact_ok boolean := coalesce(current_setting('pgfence.bypass_xact', true) = txid_current()::text, false);
    v_role text := CASE WHEN current_setting('role') = 'none' THEN session_user::text
                        ELSE current_setting('role') END;
    v_app text := current_setting('application_name', true);
    v_table text := pgfence.quoted_table(TG_TABLE_SCHEMA, TG_TABLE_NAME);
    v_advanced boolean := NEW.fence > OLD.fence;
    v_allowed boolean := false;
    v_note text;
    v_cols text;
    v_builtin boolean;
    v_key text;
    v_old bigint := OLD.fence;
BEGIN
    -- A token absurdly far ahead: refused in every mode.
    PERFORM pgfence.refuse_token_jump(pgfence.fence_token(OLD.fence), pgfence.fence_token(NEW.fence), 'table=' || v_table);
    -- A hand-written write in the write-up's form, `SET fence = $f ... WHERE ... AND fence < $f`
    -- with $f the lease's fence for SQL (Lease::fence(), PGFENCE_FENCE: its token and tag with
    -- every sequence bit set, above each fence the lease itself stores and below every newer
    -- lease's). It stores what the lease's write stores (next_fence: its first fence on a row
    -- an older lease wrote, the next step of its cycle on a row it wrote), or raises as
    -- next_fence does (PF001 stale, PF004 duplicate, PF005 sealed), so the same statement
    -- serves every write of the lease.
    IF pgfence.fence_sequence(NEW.fence) = pgfence.sealed_sequence()
       AND pgfence.fence_token(NEW.fence) > 0 AND NEW.fence <> OLD.fence THEN
        NEW.fence := pgfence.next_fence(OLD.fence, pgfence.fence_token(NEW.fence),
                                        pgfence.fence_tag(NEW.fence), v_table);
        RETURN NEW;
    END IF;
    -- A lease's write that the WHEN clause's filter did not recognise (a fresh row's first
    -- token beyond the bound): let through.
    IF (pgfence.fence_token(NEW.fence) > pgfence.fence_token(OLD.fence)
        AND pgfence.fence_sequence(NEW.fence) = 0)
       OR NEW.fence = pgfence.next_step(OLD.fence) THEN
        RETURN NEW;
    END IF;
    IF v_reason IS NOT NULL AND NOT v_xact_ok THEN
        v_note := 'pgfence.bypass was not set by pgfence.bypass() in this transaction (a plain SET outlives its transaction)';
        IF NOT v_observe THEN
            RAISE EXCEPTION 'pgfence: bypass refused on %: %', v_table, v_note
                USING ERRCODE = 'PF006',
                      DETAIL = format('role=%s reason=%s', v_role, v_reason),
                      HINT = 'BEGIN; SELECT pgfence.bypass(''<reason>''); UPDATE ...; COMMIT;',
                      SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
        END IF;
    ELSIF v_reason IS NOT NULL THEN
        v_allowed := pgfence.may_bypass(v_role);
        IF NOT v_allowed THEN
            v_note := format('role %I may not bypass the guard (the schema owner runs pgfence.allow_bypass(role))',
                             v_role);
            IF NOT v_observe THEN
                RAISE EXCEPTION 'pgfence: bypass refused on %: %', v_table, v_note
                    USING ERRCODE = 'PF006',
                          DETAIL = format('role=%s reason=%s', v_role, v_reason),
                          HINT = 'ask the schema owner to run pgfence.allow_bypass for this role, or write under a lease (pgfence run, pgfence.next_fence)',
                          SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
            END IF;
        END IF;
    ELSIF NOT v_observe THEN
        IF NEW.fence = OLD.fence THEN
            RAISE EXCEPTION 'pgfence: lease-less write refused on %: the UPDATE left fence as it was (every UPDATE of a guarded table is a lease''s write, which advances it, or an audited bypass); this rejection is recorded only in the PostgreSQL server log',
                    v_table
                USING ERRCODE = 'PF007',
                      DETAIL = format('old=%s new=%s table=%s', OLD.fence, NEW.fence, v_table),
                      HINT = 'under a lease: SET fence = $PGFENCE_FENCE (Lease::fence()) or fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG); a maintenance write: BEGIN; SELECT pgfence.bypass(''<reason>''); UPDATE ...; COMMIT;',
                      SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
        END IF;
        IF pgfence.fence_token(NEW.fence) = 0 AND NEW.fence > 0 THEN
            -- SET fence = <a token>: tokens are not fences (the write-up's `fence < $token`
            -- compares a token with the stored fence, which packs the token with more).
            RAISE EXCEPTION 'pgfence: % on %: fence % is a fence token, not a fence (a stored fence packs the token with a tag and a sequence); this rejection is recorded only in the PostgreSQL server log',
                    CASE WHEN v_advanced THEN 'lease-less write refused' ELSE 'stale fence' END,
                    v_table, NEW.fence
                USING ERRCODE = CASE WHEN v_advanced THEN 'PF007' ELSE 'PF001' END,
                      DETAIL = CASE WHEN v_advanced
                                    THEN format('old=%s new=%s table=%s', OLD.fence, NEW.fence, v_table)
                                    ELSE format('presented=%s current=%s table=%s', 0,
                                                pgfence.fence_token(OLD.fence), v_table) END,
                      HINT = 'write SET fence = $PGFENCE_FENCE ... AND fence < $PGFENCE_FENCE (Lease::fence() in Rust), not $PGFENCE_TOKEN: docs/sql.md, "Porting hand-written fenced SQL"',
                      SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
        END IF;
        IF v_advanced THEN
            RAISE EXCEPTION 'pgfence: lease-less write refused on %: fence % -> % is not a lease''s write (fence = fence + n is not one); this rejection is recorded only in the PostgreSQL server log',
                    v_table, OLD.fence, NEW.fence
                USING ERRCODE = 'PF007',
                      DETAIL = format('old=%s new=%s table=%s', OLD.fence, NEW.fence, v_table),
                      HINT = 'write under a lease (pgfence run; SET fence = $PGFENCE_FENCE, or fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG)), or as an allowed role: BEGIN; SELECT pgfence.bypass(''<reason>''); UPDATE ...; COMMIT;',
                      SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
        END IF;
        RAISE EXCEPTION 'pgfence: stale fence on %: presented token %, current token % (every UPDATE of a guarded table must be a lease''s write); this rejection is recorded only in the PostgreSQL server log',
                v_table, pgfence.fence_token(NEW.fence), pgfence.fence_token(OLD.fence)
            USING ERRCODE = 'PF001',
                  DETAIL = format('presented=%s current=%s table=%s',
                                  pgfence.fence_token(NEW.fence), pgfence.fence_token(OLD.fence), v_table),
                  HINT = 'set fence = $PGFENCE_FENCE (Lease::fence()) or pgfence.next_fence(fence, <token>, <tag>) under a lease (pgfence run), write through the pgfence repository, or bypass: BEGIN; SELECT pgfence.bypass(''<reason>''); UPDATE ...; COMMIT;',
                  SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
    END IF;

    -- Let through: a bypass by an allowed role, or observe mode. Say which row.
    SELECT string_agg(format('($1).%I', a.attname), ', ' ORDER BY k.ord),
           bool_and(a.atttypid < 16384)
      INTO v_cols, v_builtin
      FROM pg_index i
     CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
     WHERE i.indrelid = TG_RELID AND i.indisprimary;
    IF v_cols IS NOT NULL AND v_builtin THEN
        EXECUTE format('SELECT pg_catalog.jsonb_build_array(%s)::pg_catalog.text', v_cols)
           INTO v_key USING OLD;
    END IF;

    -- Seal the row against every lease that wrote it before (see the header): the lease
    -- whose fence the row had cannot write it again, and neither can anything older. A fence
    -- of a newer token set by hand is sealed too.
    NEW.fence := CASE WHEN pgfence.fence_token(NEW.fence) > pgfence.fence_token(v_old)
                      THEN pgfence.sealed_fence(NEW.fence)
                      ELSE pgfence.sealed_fence(v_old) END;

    IF v_allowed THEN
        INSERT INTO pgfence.audit (table_name, row_key, presented, current, holder, operation,
                                   application_name, reason)
        VALUES (v_table, v_key, pgfence.fence_token(NEW.fence), pgfence.fence_token(v_old), v_role, 'bypass', v_app, v_reason);
        RAISE WARNING 'pgfence: guard bypassed on % row % by role % (application %): %',
                v_table, coalesce(v_key, '?'), v_role, coalesce(v_app, ''), v_reason
            USING DETAIL = format('presented=%s current=%s table=%s', pgfence.fence_token(NEW.fence), pgfence.fence_token(v_old), v_table);
    ELSE
        INSERT INTO pgfence.audit (table_name, row_key, presented, current, holder, operation,
                                   application_name, reason)
        VALUES (v_table, v_key, pgfence.fence_token(NEW.fence), pgfence.fence_token(v_old), v_role, 'observe', v_app,
                CASE WHEN v_note IS NOT NULL
                     THEN format('bypass %L refused: %s', v_reason, v_note) END);
        RAISE WARNING 'pgfence: observe mode: unfenced update of % row % by role % (application %) would be rejected when enforcing (row sealed against earlier leases)%',
                v_table, coalesce(v_key, '?'), v_role, coalesce(v_app, ''),
                CASE WHEN v_note IS NULL THEN '' ELSE '; ' || v_note END
            USING DETAIL = format('presented=%s current=%s table=%s', pgfence.fence_token(NEW.fence), pgfence.fence_token(v_old), v_table),
                  HINT = 'write under a lease (pgfence run, pgfence.next_fence), or as an allowed role: SELECT pgfence.bypass(''<reason>'') in the transaction';
    END IF;
    RETURN NEW;
END
$$;

-- The guard trigger of a table, as DDL after CREATE / CREATE OR REPLACE: the one place its
-- WHEN clause is written. The clause is a cheap filter of literals formatted from the layout's
-- helpers, kept small on purpose (PostgreSQL re-reads a trigger's WHEN for every statement, so
-- its size is paid on every write — an earlier, complete form cost a single-row UPDATE ~5 µs
-- more). It lets through, without calling the trigger function, exactly:
--   * a newer token's write (NEW above every fence of OLD's token) whose jump is within the
--     poisoning bound (baked in from pgfence.max_token_jump() when the trigger is installed;
--     pgfence.set_max_token_jump re-installs every guard trigger), and
--   * the same fence's next step in the lease's sequence cycle (NEW - OLD = 2731 or -1364).
-- Everything else reaches pgfence.reject_stale_update, which lets a lease's write the filter
-- did not recognise through (a fresh row's first token beyond the bound) and rejects the
-- rest. What the filter lets through that a lease never writes: a newer token's fence with a
-- sequence other than 0 (a hand-copied fence: it fences out every older lease, as a newer
-- lease's write would), and `fence - 1364` on a sealed fence (unseals it; no accident
-- produces that number).
CREATE OR REPLACE FUNCTION pgfence.guard_trigger_ddl(p_rel regclass, p_mode text) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT format(
        'TRIGGER pgfence_guard BEFORE UPDATE ON %s FOR EACH ROW '
        'WHEN ((NEW.fence OPERATOR(pg_catalog.<=) (OLD.fence OPERATOR(pg_catalog.|) %s::pg_catalog.int8) '
        'AND (NEW.fence OPERATOR(pg_catalog.-) OLD.fence) OPERATOR(pg_catalog.<>) ALL (''{%s,%s}''::pg_catalog.int8[])) '
        'OR (NEW.fence OPERATOR(pg_catalog.-) OLD.fence) OPERATOR(pg_catalog.>) %s::pg_catalog.int8 '
        'OR (NEW.fence OPERATOR(pg_catalog.&) %s::pg_catalog.int8) OPERATOR(pg_catalog.=) %s::pg_catalog.int8) '
        'EXECUTE FUNCTION pgfence.reject_stale_update(%s)', p_rel,
        pgfence.token_fence(1) - 1,
        pgfence.sequence_step(), pgfence.sequence_step() - pgfence.sealed_sequence(),
        pgfence.token_fence(pgfence.max_token_jump()),
        pgfence.sealed_sequence(), pgfence.sealed_sequence(),
        CASE p_mode WHEN 'observe' THEN '''observe''' ELSE '' END)
$$;

-- Installs (or replaces) the guard trigger of p_rel in mode p_mode, keeping a disabled
-- trigger disabled. Returns nothing; guard(), set_max_token_jump and section 12 call it.
CREATE OR REPLACE FUNCTION pgfence.install_guard_trigger(p_rel regclass, p_mode text) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_enabled "char";
BEGIN
    SELECT t.tgenabled INTO v_enabled
      FROM pg_trigger t WHERE t.tgrelid = p_rel AND t.tgname = 'pgfence_guard';
    IF NOT FOUND THEN
        EXECUTE 'CREATE ' || pgfence.guard_trigger_ddl(p_rel, p_mode);
        RETURN;
    END IF;
    IF current_setting('server_version_num')::integer >= 140000 THEN
        EXECUTE 'CREATE OR REPLACE ' || pgfence.guard_trigger_ddl(p_rel, p_mode);
    ELSE
        EXECUTE format('DROP TRIGGER pgfence_guard ON %s', p_rel);
        EXECUTE 'CREATE ' || pgfence.guard_trigger_ddl(p_rel, p_mode);
    END IF;
    IF v_enabled = 'D' THEN
        EXECUTE format('ALTER TABLE %s DISABLE TRIGGER pgfence_guard', p_rel);
    END IF;
END
$$;

-- Guards a table in a mode (enforce or observe): adds the fence column when missing and
-- installs the guard trigger. Returns true when something changed.
CREATE OR REPLACE FUNCTION pgfence.guard(p_schema text, p_table text, p_mode text) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rel regclass;
    col_type text;
    col_notnull boolean;
    changed boolean := false;
    v_trigger record;
BEGIN
    IF p_mode IS NULL OR p_mode NOT IN ('enforce', 'observe') THEN
        RAISE EXCEPTION 'pgfence: guard modes are enforce and observe, got %', p_mode
            USING ERRCODE = '22023';
    END IF;
    IF p_schema IN ('pgfence', 'information_schema') OR p_schema LIKE 'pg\_%' THEN
        RAISE EXCEPTION 'pgfence: refusing to guard %.%: pgfence and system tables cannot be guarded',
                quote_ident(p_schema), quote_ident(p_table)
            USING ERRCODE = 'PF003', SCHEMA = p_schema, TABLE = format('%I.%I', p_schema, p_table);
    END IF;
    v_rel := pgfence.resolve_table(p_schema, p_table);

    -- Self-conflicting lock: concurrent guards of one table run one after the other.
    EXECUTE format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', v_rel);

    SELECT format_type(a.atttypid, a.atttypmod), a.attnotnull INTO col_type, col_notnull
      FROM pg_attribute a
     WHERE a.attrelid = v_rel AND a.attname = 'fence' AND NOT a.attisdropped;

    IF col_type IS NULL THEN
        EXECUTE format('ALTER TABLE %s ADD COLUMN fence bigint NOT NULL DEFAULT 0', v_rel);
        changed := true;
    ELSIF col_type <> 'bigint' THEN
        RAISE EXCEPTION 'pgfence: %.fence has type %, expected bigint', v_rel, col_type
            USING ERRCODE = 'PF002', DETAIL = col_type, SCHEMA = p_schema, TABLE = v_rel::text;
    ELSIF NOT col_notnull THEN
        EXECUTE format('UPDATE %s SET fence = 0 WHERE fence IS NULL', v_rel);
        EXECUTE format('ALTER TABLE %s ALTER COLUMN fence SET DEFAULT 0, ALTER COLUMN fence SET NOT NULL', v_rel);
        changed := true;
    END IF;

    SELECT t.tgnargs, t.tgargs, t.tgenabled INTO v_trigger
      FROM pg_trigger t WHERE t.tgrelid = v_rel AND t.tgname = 'pgfence_guard';
    IF NOT FOUND OR pgfence.trigger_mode(v_trigger.tgnargs, v_trigger.tgargs) <> p_mode THEN
        PERFORM pgfence.install_guard_trigger(v_rel, p_mode);
        changed := true;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = v_rel AND t.tgname = 'pgfence_guard'
                  AND t.tgenabled NOT IN ('O', 'A')) THEN
        EXECUTE format('ALTER TABLE %s ENABLE TRIGGER pgfence_guard', v_rel);
        changed := true;
    END IF;
    INSERT INTO pgfence.guarded_table (rel) VALUES (v_rel::oid) ON CONFLICT DO NOTHING;
    RETURN changed;
END
$$;

-- Owner-only: allow or disallow a role to bypass the guard. A role allowed to bypass may call
-- pgfence.bypass (it needs the schema too); disallowing takes the function back. allow_bypass
-- raises 42704 for a role that does not exist; both return true when something changed.
CREATE OR REPLACE FUNCTION pgfence.allow_bypass(p_role text) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles r WHERE r.rolname = p_role) THEN
        RAISE EXCEPTION 'pgfence: role % does not exist', quote_ident(p_role) USING ERRCODE = '42704';
    END IF;
    EXECUTE format('GRANT USAGE ON SCHEMA pgfence TO %I', p_role);
    EXECUTE format('GRANT EXECUTE ON FUNCTION pgfence.bypass(text) TO %I', p_role);
    INSERT INTO pgfence.bypass_role (role) VALUES (p_role) ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$$;

CREATE OR REPLACE FUNCTION pgfence.disallow_bypass(p_role text) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM pgfence.bypass_role WHERE role = p_role;
    IF FOUND AND EXISTS (SELECT 1 FROM pg_roles r WHERE r.rolname = p_role) THEN
        EXECUTE format('REVOKE EXECUTE ON FUNCTION pgfence.bypass(text) FROM %I', p_role);
        RETURN true;
    END IF;
    RETURN FOUND;
END
$$;

-- bypass is granted by allow_bypass to the roles it allows.
REVOKE ALL ON FUNCTION pgfence.bypass(text),
    pgfence.guard_trigger_ddl(regclass, text), pgfence.install_guard_trigger(regclass, text)
    FROM PUBLIC;

------------------------------------------------------------------------------------------------
-- 9. The PostgreSQL issuer (pgfence::issuer::PgIssuer)
--
-- Leases and fence tokens kept in the database the fences live in. A lock is a row of
-- pgfence.issuer_lock, a token counter a row of pgfence.issuer_counter; both are keyed by the
-- issuer's key prefix, so two prefixes on one database share no lock and no counter. Idle
-- counters and lapsed lock rows can be expired (pgfence.issuer_expire_idle): a counter's value
-- is then kept in one of 4,096 floors per prefix (pgfence.issuer_floor) it restarts above.
--
-- * Expiry is by the database clock (clock_timestamp()), never the client's.
-- * Every operation is one statement calling one function: no session state (no advisory
--   lock, no SET, no LISTEN), so it works through a transaction-mode pooler.
-- * The functions run with their owner's rights (SECURITY DEFINER, pinned search_path, static
--   SQL only). An application role gets EXECUTE on them (pgfence grant) and nothing on the
--   tables: it can take a free lock and release or extend a lock it holds (owner id and token
--   both match), never lower a counter or take a live lock from its holder.
-- * The functions that read or write the tables also set enable_seqscan = off: PL/pgSQL
--   caches one plan per statement per session, and a session that planned while a table was
--   small kept a sequential scan as the table grew (measured in the bench: an acquire at
--   20,000 rows took 4.2 ms instead of 0.3 ms). Every lookup here is by primary key.
-- * The counter and the fences it protects commit in the same WAL: a token can never be
--   behind a fence written after it was issued, and a database failover moves both together.
--   There is nothing to reseed.
------------------------------------------------------------------------------------------------

CREATE TABLE IF NOT EXISTS pgfence.issuer_counter (
    prefix     text        NOT NULL,
    counter    text        NOT NULL,
    value      bigint      NOT NULL CHECK (value >= 0),
    -- When an acquire last drew a token from it (pgfence.issuer_expire_idle's idle time).
    touched_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (prefix, counter)
);
-- A database that ran an earlier build of this migration has the table without it.
ALTER TABLE pgfence.issuer_counter
    ADD COLUMN IF NOT EXISTS touched_at timestamptz NOT NULL DEFAULT now();

CREATE TABLE IF NOT EXISTS pgfence.issuer_lock (
    prefix     text        NOT NULL,
    resource   text        NOT NULL,
    owner      text        NOT NULL,
    token      bigint      NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (prefix, resource)
);

REVOKE ALL ON pgfence.issuer_counter, pgfence.issuer_lock FROM PUBLIC;

-- The floors of expired counters (pgfence.issuer_expire_idle): a counter that went idle is
-- deleted and its value kept here, in one of 4,096 buckets per key prefix (the highest value
-- of the counters that hash to it). A counter created again starts above its bucket's floor,
-- so its tokens stay above every token it issued before: the state kept per prefix is bounded
-- whatever the number of resources ever locked.
CREATE TABLE IF NOT EXISTS pgfence.issuer_floor (
    prefix text    NOT NULL,
    bucket integer NOT NULL CHECK (bucket >= 0 AND bucket < 4096),
    value  bigint  NOT NULL CHECK (value >= 0),
    PRIMARY KEY (prefix, bucket)
);

REVOKE ALL ON pgfence.issuer_floor FROM PUBLIC;

-- The bucket of pgfence.issuer_floor a counter's floor is kept in: 12 bits of its name's MD5
-- (stable across PostgreSQL versions and platforms, unlike hashtext).
CREATE OR REPLACE FUNCTION pgfence.issuer_floor_bucket(p_counter text) RETURNS integer
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT ('x' OPERATOR(pg_catalog.||) substr(md5(p_counter), 1, 3))::bit(12)::integer
$$;

-- The counter a resource draws tokens from: its fencing domain ('{D}NAME' -> 'D'), else itself.
CREATE OR REPLACE FUNCTION pgfence.issuer_counter_id(p_resource text) RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE
        WHEN left(p_resource, 1) OPERATOR(pg_catalog.=) '{'
             AND strpos(p_resource, '}') OPERATOR(pg_catalog.>) 2
        THEN substr(p_resource, 2, strpos(p_resource, '}') OPERATOR(pg_catalog.-) 2)
        ELSE p_resource
    END
$$;

-- Refuses bad arguments (22023) before anything is read or written.
CREATE OR REPLACE FUNCTION pgfence.issuer_check_args(p_prefix text, p_resource text, p_owner text,
                                          p_ttl_ms bigint) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_prefix IS NULL OR p_prefix OPERATOR(pg_catalog.=) ''
       OR octet_length(p_prefix) OPERATOR(pg_catalog.>) 64 THEN
        RAISE EXCEPTION 'pgfence: a key prefix is 1 to 64 bytes' USING ERRCODE = '22023';
    END IF;
    IF p_resource IS NULL OR p_resource OPERATOR(pg_catalog.=) ''
       OR octet_length(p_resource) OPERATOR(pg_catalog.>) 200 THEN
        RAISE EXCEPTION 'pgfence: a resource name is 1 to 200 bytes' USING ERRCODE = '22023';
    END IF;
    IF p_owner IS NOT NULL AND (p_owner OPERATOR(pg_catalog.=) ''
       OR strpos(p_owner, ':') OPERATOR(pg_catalog.>) 0
       OR octet_length(p_owner) OPERATOR(pg_catalog.>) 256) THEN
        RAISE EXCEPTION 'pgfence: owner ids are 1 to 256 bytes and contain no '':'''
            USING ERRCODE = '22023';
    END IF;
    IF p_ttl_ms IS NOT NULL AND (p_ttl_ms OPERATOR(pg_catalog.<) 10
       OR p_ttl_ms OPERATOR(pg_catalog.>) 86400000) THEN
        RAISE EXCEPTION 'pgfence: a lease TTL is 10 ms to 24 h, not % ms', p_ttl_ms
            USING ERRCODE = '22023';
    END IF;
END
$$;

-- Takes p_resource's lock for p_ttl_ms if it is free or expired and mints its token from the
-- resource's (or its domain's) counter. Returns (true, token, ttl_ms) when granted: also to
-- the same owner again while it holds the lock (the retry after a lost reply: same token, TTL
-- renewed). Returns (false, NULL, remaining ms) when another owner holds it.
--
-- A counter that does not exist yet starts above the high-water mark PostgreSQL recorded for
-- the resource (or the domain) under the issuer's key prefix, so a resource that was fenced
-- with another issuer's tokens keeps working, and above its bucket's floor in
-- pgfence.issuer_floor, so a counter that expired idle (pgfence.issuer_expire_idle) never
-- issues a token again that it issued before. A token past pgfence.max_token() is refused with
-- 22003 and, since the whole statement then rolls back, the lock and the counter stay as they
-- were.
CREATE OR REPLACE FUNCTION pgfence.issuer_acquire(p_prefix text, p_resource text, p_owner text,
                                       p_ttl_ms bigint)
RETURNS TABLE (acquired boolean, token bigint, ttl_ms bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_until timestamptz;
    v_held pgfence.issuer_lock;
    v_counter text;
    v_floor bigint;
    v_token bigint;
BEGIN
    IF p_owner IS NULL OR p_ttl_ms IS NULL THEN
        RAISE EXCEPTION 'pgfence: issuer_acquire needs an owner id and a TTL' USING ERRCODE = '22023';
    END IF;
    PERFORM pgfence.issuer_check_args(p_prefix, p_resource, p_owner, p_ttl_ms);
    v_until := clock_timestamp() OPERATOR(pg_catalog.+)
               make_interval(secs => p_ttl_ms::double precision OPERATOR(pg_catalog./) 1000);
    -- Take the row if it is new or its lock has expired. A conflicting row that is not taken
    -- is still locked by this statement, so what is read next is what holds it.
    INSERT INTO pgfence.issuer_lock AS l (prefix, resource, owner, token, expires_at)
    VALUES (p_prefix, p_resource, p_owner, 0, v_until)
    ON CONFLICT (prefix, resource) DO UPDATE
        SET owner = EXCLUDED.owner, token = 0, expires_at = EXCLUDED.expires_at
        WHERE l.expires_at OPERATOR(pg_catalog.<=) clock_timestamp();
    IF NOT FOUND THEN
        SELECT * INTO v_held FROM pgfence.issuer_lock l
         WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
           AND l.resource OPERATOR(pg_catalog.=) p_resource;
        IF v_held.owner OPERATOR(pg_catalog.=) p_owner THEN
            UPDATE pgfence.issuer_lock l SET expires_at = v_until
             WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
               AND l.resource OPERATOR(pg_catalog.=) p_resource;
            RETURN QUERY SELECT true, v_held.token, p_ttl_ms;
            RETURN;
        END IF;
        RETURN QUERY SELECT false, NULL::bigint,
            greatest(1, ceil(extract(epoch FROM v_held.expires_at OPERATOR(pg_catalog.-)
                                                 clock_timestamp())
                             OPERATOR(pg_catalog.*) 1000))::bigint;
        RETURN;
    END IF;
    v_counter := pgfence.issuer_counter_id(p_resource);
    UPDATE pgfence.issuer_counter c
       SET value = c.value OPERATOR(pg_catalog.+) 1, touched_at = now()
     WHERE c.prefix OPERATOR(pg_catalog.=) p_prefix
       AND c.counter OPERATOR(pg_catalog.=) v_counter
    RETURNING c.value INTO v_token;
    IF NOT FOUND THEN
        -- The marks of this key prefix (the default prefix's are the plain names; another
        -- prefix P fences R as 'P{R' and domain D as 'P{D': Resource::in_key_prefix).
        IF v_counter OPERATOR(pg_catalog.=) p_resource THEN
            v_floor := pgfence.high_water(CASE WHEN p_prefix OPERATOR(pg_catalog.=) 'pgfence'
                                               THEN p_resource
                                               ELSE p_prefix OPERATOR(pg_catalog.||) '{'
                                                    OPERATOR(pg_catalog.||) p_resource END);
        ELSE
            v_floor := pgfence.domain_high_water(CASE WHEN p_prefix OPERATOR(pg_catalog.=) 'pgfence'
                                                      THEN v_counter
                                                      ELSE p_prefix OPERATOR(pg_catalog.||) '{'
                                                           OPERATOR(pg_catalog.||) v_counter END);
        END IF;
        -- Above what this counter issued before it expired idle (its bucket's floor).
        v_floor := greatest(v_floor, coalesce((
            SELECT f.value FROM pgfence.issuer_floor f
             WHERE f.prefix OPERATOR(pg_catalog.=) p_prefix
               AND f.bucket OPERATOR(pg_catalog.=) pgfence.issuer_floor_bucket(v_counter)), 0));
        INSERT INTO pgfence.issuer_counter AS c (prefix, counter, value)
        VALUES (p_prefix, v_counter, v_floor OPERATOR(pg_catalog.+) 1)
        ON CONFLICT (prefix, counter) DO UPDATE
            SET value = c.value OPERATOR(pg_catalog.+) 1, touched_at = now()
        RETURNING c.value INTO v_token;
    END IF;
    IF v_token OPERATOR(pg_catalog.>) pgfence.max_token() THEN
        RAISE EXCEPTION 'pgfence: the token counter of % would pass the token limit %',
                p_resource, pgfence.max_token()
            USING ERRCODE = '22003',
                  DETAIL = format('counter=%s token=%s', v_counter, v_token);
    END IF;
    UPDATE pgfence.issuer_lock l SET token = v_token
     WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
       AND l.resource OPERATOR(pg_catalog.=) p_resource;
    RETURN QUERY SELECT true, v_token, p_ttl_ms;
END
$$;

-- What a lease's release or extend found when it does not hold the lock: -1 when another
-- lease holds it, 0 when nobody does (expired, released, or deleted).
CREATE OR REPLACE FUNCTION pgfence.issuer_not_held(p_prefix text, p_resource text) RETURNS integer
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
    SELECT CASE WHEN EXISTS (
        SELECT 1 FROM pgfence.issuer_lock l
         WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
           AND l.resource OPERATOR(pg_catalog.=) p_resource
           AND l.expires_at OPERATOR(pg_catalog.>) clock_timestamp()
    ) THEN -1 ELSE 0 END
$$;

-- Releases the lock if the lease (owner and token) holds it: 1 released, 0 it had expired
-- (nobody holds it; a lapsed row of this lease is removed), -1 another lease holds it
-- (untouched). The counter is left alone.
CREATE OR REPLACE FUNCTION pgfence.issuer_release(p_prefix text, p_resource text, p_owner text,
                                       p_token bigint) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_expires timestamptz;
BEGIN
    PERFORM pgfence.issuer_check_args(p_prefix, p_resource, p_owner, NULL);
    DELETE FROM pgfence.issuer_lock l
     WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
       AND l.resource OPERATOR(pg_catalog.=) p_resource
       AND l.owner OPERATOR(pg_catalog.=) p_owner
       AND l.token OPERATOR(pg_catalog.=) p_token
    RETURNING l.expires_at INTO v_expires;
    IF FOUND THEN
        RETURN CASE WHEN v_expires OPERATOR(pg_catalog.>) clock_timestamp() THEN 1 ELSE 0 END;
    END IF;
    RETURN pgfence.issuer_not_held(p_prefix, p_resource);
END
$$;

-- Extends the lock to p_ttl_ms from now if the lease (owner and token) still holds it:
-- 1 held (extended), 0 expired (nobody holds it), -1 another lease holds it.
CREATE OR REPLACE FUNCTION pgfence.issuer_extend(p_prefix text, p_resource text, p_owner text,
                                      p_token bigint, p_ttl_ms bigint) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
BEGIN
    IF p_ttl_ms IS NULL THEN
        RAISE EXCEPTION 'pgfence: issuer_extend needs a TTL' USING ERRCODE = '22023';
    END IF;
    PERFORM pgfence.issuer_check_args(p_prefix, p_resource, p_owner, p_ttl_ms);
    UPDATE pgfence.issuer_lock l
       SET expires_at = clock_timestamp() OPERATOR(pg_catalog.+)
                        make_interval(secs => p_ttl_ms::double precision OPERATOR(pg_catalog./) 1000)
     WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
       AND l.resource OPERATOR(pg_catalog.=) p_resource
       AND l.owner OPERATOR(pg_catalog.=) p_owner
       AND l.token OPERATOR(pg_catalog.=) p_token
       AND l.expires_at OPERATOR(pg_catalog.>) clock_timestamp();
    IF FOUND THEN
        RETURN 1;
    END IF;
    RETURN pgfence.issuer_not_held(p_prefix, p_resource);
END
$$;

-- The lock and counter of p_resource: the holder's owner id, token and remaining ms (NULLs
-- when nobody holds it) and the counter's value (the last token issued; 0 when none).
CREATE OR REPLACE FUNCTION pgfence.issuer_status(p_prefix text, p_resource text)
RETURNS TABLE (owner text, token bigint, ttl_ms bigint, counter bigint)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
BEGIN
    PERFORM pgfence.issuer_check_args(p_prefix, p_resource, NULL, NULL);
    RETURN QUERY
    SELECT l.owner, l.token,
           CASE WHEN l.expires_at IS NOT NULL THEN
               greatest(1, ceil(extract(epoch FROM l.expires_at OPERATOR(pg_catalog.-)
                                                    clock_timestamp())
                                OPERATOR(pg_catalog.*) 1000))::bigint
           END,
           coalesce((SELECT c.value FROM pgfence.issuer_counter c
                      WHERE c.prefix OPERATOR(pg_catalog.=) p_prefix
                        AND c.counter OPERATOR(pg_catalog.=) pgfence.issuer_counter_id(p_resource)),
                    0::bigint)
      FROM (SELECT 1) AS one
      LEFT JOIN pgfence.issuer_lock l
        ON l.prefix OPERATOR(pg_catalog.=) p_prefix
       AND l.resource OPERATOR(pg_catalog.=) p_resource
       AND l.expires_at OPERATOR(pg_catalog.>) clock_timestamp();
END
$$;

-- Expires the issuer state of p_prefix's idle resources (PgIssuer::with_idle_expiry): counters
-- no acquire used for p_idle_ms are deleted and folded into pgfence.issuer_floor (a counter
-- created again starts above its bucket's floor, so tokens never go back), and lock rows that
-- lapsed p_idle_ms ago are deleted. At most p_limit of each per call; rows another transaction
-- holds are skipped. Returns how many counters and lock rows were deleted. Safe to call at any
-- time, by any role the issuer runs as: it can neither lower a token nor free a live lock.
CREATE OR REPLACE FUNCTION pgfence.issuer_expire_idle(p_prefix text, p_idle_ms bigint,
                                           p_limit integer)
RETURNS TABLE (counters bigint, locks bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_cut timestamptz;
    v_counters bigint;
    v_locks bigint;
BEGIN
    PERFORM pgfence.issuer_check_args(p_prefix, 'any', NULL, NULL);
    IF p_idle_ms IS NULL OR p_idle_ms OPERATOR(pg_catalog.<) 1000
       OR p_limit IS NULL OR p_limit OPERATOR(pg_catalog.<) 1 THEN
        RAISE EXCEPTION 'pgfence: issuer_expire_idle takes an idle time of at least 1000 ms and a limit of at least 1'
            USING ERRCODE = '22023';
    END IF;
    v_cut := clock_timestamp() OPERATOR(pg_catalog.-)
             make_interval(secs => p_idle_ms::double precision OPERATOR(pg_catalog./) 1000);
    WITH gone AS (
        DELETE FROM pgfence.issuer_counter c
         WHERE c.prefix OPERATOR(pg_catalog.=) p_prefix
           AND c.counter IN (SELECT i.counter FROM pgfence.issuer_counter i
                              WHERE i.prefix OPERATOR(pg_catalog.=) p_prefix
                                AND i.touched_at OPERATOR(pg_catalog.<) v_cut
                              LIMIT p_limit
                                FOR UPDATE SKIP LOCKED)
        RETURNING c.counter, c.value
    ), folded AS (
        INSERT INTO pgfence.issuer_floor AS f (prefix, bucket, value)
        SELECT p_prefix, pgfence.issuer_floor_bucket(g.counter), max(g.value)
          FROM gone g
         GROUP BY 2
        ON CONFLICT (prefix, bucket) DO UPDATE SET value = greatest(f.value, EXCLUDED.value)
    )
    SELECT count(*) INTO v_counters FROM gone;
    DELETE FROM pgfence.issuer_lock l
     WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
       AND l.resource IN (SELECT i.resource FROM pgfence.issuer_lock i
                           WHERE i.prefix OPERATOR(pg_catalog.=) p_prefix
                             AND i.expires_at OPERATOR(pg_catalog.<) v_cut
                           LIMIT p_limit
                             FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_locks = ROW_COUNT;
    RETURN QUERY SELECT v_counters, v_locks;
END
$$;

-- What the issuer keeps for p_prefix: its counters, of them those no live lock draws from
-- (idle), its lock rows (held or lapsed) and its floors (pgfence.issuer_floor).
CREATE OR REPLACE FUNCTION pgfence.issuer_state(p_prefix text)
RETURNS TABLE (counters bigint, idle bigint, locks bigint, floors bigint)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH live AS (
        SELECT DISTINCT pgfence.issuer_counter_id(l.resource) AS counter
          FROM pgfence.issuer_lock l
         WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
           AND l.expires_at OPERATOR(pg_catalog.>) clock_timestamp()
    )
    SELECT (SELECT count(*) FROM pgfence.issuer_counter c
             WHERE c.prefix OPERATOR(pg_catalog.=) p_prefix),
           (SELECT count(*) FROM pgfence.issuer_counter c
             WHERE c.prefix OPERATOR(pg_catalog.=) p_prefix
               AND NOT EXISTS (SELECT 1 FROM live WHERE live.counter OPERATOR(pg_catalog.=) c.counter)),
           (SELECT count(*) FROM pgfence.issuer_lock l
             WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix),
           (SELECT count(*) FROM pgfence.issuer_floor f
             WHERE f.prefix OPERATOR(pg_catalog.=) p_prefix)
$$;

REVOKE ALL ON FUNCTION
    pgfence.issuer_counter_id(text),
    pgfence.issuer_floor_bucket(text),
    pgfence.issuer_check_args(text, text, text, bigint),
    pgfence.issuer_acquire(text, text, text, bigint),
    pgfence.issuer_not_held(text, text),
    pgfence.issuer_release(text, text, text, bigint),
    pgfence.issuer_extend(text, text, text, bigint, bigint),
    pgfence.issuer_status(text, text),
    pgfence.issuer_expire_idle(text, bigint, integer),
    pgfence.issuer_state(text)
FROM PUBLIC;

------------------------------------------------------------------------------------------------
-- 10. The effect ledger (pgfence::Effects)
--
-- Side effects outside PostgreSQL — a payment provider's charge, an e-mail — recorded under a
-- lease before they are made, with an idempotency key that is the same for every holder of the
-- work item.
--
-- An effect is one row per (scope, work_key, step), where the scope is the lease's token
-- counter: its resource, or its fencing domain ('{D}NAME' -> 'D'). Its idempotency key is
-- drawn at random when the first lease records the effect and never changes: a new holder of
-- the same work item, or a zombie that recorded it and paused before calling, sends the same
-- key, so a provider that honours idempotency keys makes the call once. The key never derives
-- from a token (a zombie's token differs from the new holder's).
--
-- The row's fence is a packed fence like a guarded row's (advanced by pgfence.next_fence):
-- recording or finishing an effect is a fenced write. A lease older than the one that last
-- recorded the effect — or than the newest check of its resource — is refused ('stale'),
-- before it calls; so is an older lease's outcome, which cannot overwrite a newer holder's.
--
-- The functions return a status instead of raising, so a refusal does not abort the caller's
-- transaction; the library audits the refusal through its own connection (it survives the
-- caller's rollback). Like the PostgreSQL issuer's functions they set enable_seqscan = off
-- (every lookup is by primary key; a cached plan must not keep a small table's sequential
-- scan). They run with their owner's rights; the application role gets EXECUTE
-- (pgfence grant) and nothing on the table.
------------------------------------------------------------------------------------------------

CREATE TABLE IF NOT EXISTS pgfence.effect (
    scope           text        NOT NULL,
    work_key        text        NOT NULL,
    step            text        NOT NULL,
    idempotency_key text        NOT NULL UNIQUE,
    fence           bigint      NOT NULL,
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'succeeded', 'failed')),
    outcome         jsonb,
    holders         integer     NOT NULL DEFAULT 1,
    resource        text        NOT NULL,
    holder          text,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (scope, work_key, step)
);
REVOKE ALL ON pgfence.effect FROM PUBLIC;

CREATE OR REPLACE FUNCTION pgfence.effect_check_args(p_resource text, p_work_key text, p_step text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_resource IS NULL OR p_resource = '' OR octet_length(p_resource) > 200 THEN
        RAISE EXCEPTION 'pgfence: a resource name is 1 to 200 bytes' USING ERRCODE = '22023';
    END IF;
    IF p_work_key IS NULL OR p_work_key = '' OR octet_length(p_work_key) > 200 THEN
        RAISE EXCEPTION 'pgfence: an effect''s work key is 1 to 200 bytes' USING ERRCODE = '22023';
    END IF;
    IF p_step IS NULL OR p_step = '' OR octet_length(p_step) > 100 THEN
        RAISE EXCEPTION 'pgfence: an effect''s step is 1 to 100 bytes' USING ERRCODE = '22023';
    END IF;
END
$$;

-- Records (or takes over) an effect before its call. Returns status 'ok' with the effect's
-- idempotency key, its state and the outcome a previous holder recorded ('succeeded' or
-- 'failed' with outcome: the call is known to be done; 'pending': make the call with the
-- key), and how many leases have recorded it. Returns 'stale' / 'duplicate' / 'exhausted'
-- (PF001 / PF004 / PF005 of pgfence.next_fence) with the token met, and nothing changed.
CREATE OR REPLACE FUNCTION pgfence.effect_begin(p_resource text, p_work_key text, p_step text,
                                     p_token bigint, p_tag integer, p_holder text)
RETURNS TABLE (status text, idempotency_key text, state text, outcome jsonb, holders integer,
               current bigint, other_counter boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_scope text := pgfence.issuer_counter_id(p_resource);
    v_mark bigint;
    v_row pgfence.effect;
    v_code text;
    v_detail text;
BEGIN
    PERFORM pgfence.effect_check_args(p_resource, p_work_key, p_step);
    -- A newer lease already checked the resource: fenced out before the call.
    v_mark := pgfence.high_water(p_resource);
    IF v_mark > p_token THEN
        RETURN QUERY SELECT 'stale'::text, NULL::text, NULL::text, NULL::jsonb, NULL::integer,
                            v_mark, false;
        RETURN;
    END IF;
    BEGIN
        INSERT INTO pgfence.effect AS e (scope, work_key, step, idempotency_key, fence,
                                         resource, holder)
        VALUES (v_scope, p_work_key, p_step, gen_random_uuid()::text,
                pgfence.lease_fence(p_token, p_tag), p_resource, p_holder)
        ON CONFLICT (scope, work_key, step) DO UPDATE
            SET fence = pgfence.next_fence(e.fence, p_token, p_tag, '"pgfence"."effect"'),
                holders = e.holders + CASE WHEN pgfence.fence_token(e.fence) < p_token THEN 1 ELSE 0 END,
                resource = p_resource,
                holder = p_holder,
                updated_at = clock_timestamp()
        RETURNING e.* INTO v_row;
    EXCEPTION WHEN SQLSTATE 'PF001' OR SQLSTATE 'PF004' OR SQLSTATE 'PF005' THEN
        GET STACKED DIAGNOSTICS v_code = RETURNED_SQLSTATE, v_detail = PG_EXCEPTION_DETAIL;
        RETURN QUERY SELECT CASE v_code WHEN 'PF001' THEN 'stale'
                                        WHEN 'PF004' THEN 'duplicate'
                                        ELSE 'exhausted' END,
                            NULL::text, NULL::text, NULL::jsonb, NULL::integer,
                            substring(v_detail FROM 'current=([0-9]+)')::bigint,
                            strpos(v_detail, 'origin=other') > 0;
        RETURN;
    END;
    RETURN QUERY SELECT 'ok'::text, v_row.idempotency_key, v_row.state, v_row.outcome,
                        v_row.holders, pgfence.fence_token(v_row.fence), false;
END
$$;

-- Records an effect's outcome after its call (p_succeeded: the call did what it was for;
-- false: it definitely did not, e.g. a declined card), fenced like effect_begin. Returns 'ok',
-- 'missing' (no lease recorded the effect first: nothing written), or 'stale' / 'duplicate' /
-- 'exhausted' with the token met (a newer holder's outcome is never overwritten).
CREATE OR REPLACE FUNCTION pgfence.effect_finish(p_resource text, p_work_key text, p_step text,
                                      p_token bigint, p_tag integer, p_holder text,
                                      p_succeeded boolean, p_outcome jsonb)
RETURNS TABLE (status text, current bigint, other_counter boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_scope text := pgfence.issuer_counter_id(p_resource);
    v_mark bigint;
    v_code text;
    v_detail text;
BEGIN
    PERFORM pgfence.effect_check_args(p_resource, p_work_key, p_step);
    IF p_succeeded IS NULL THEN
        RAISE EXCEPTION 'pgfence: effect_finish needs p_succeeded' USING ERRCODE = '22023';
    END IF;
    v_mark := pgfence.high_water(p_resource);
    IF v_mark > p_token THEN
        RETURN QUERY SELECT 'stale'::text, v_mark, false;
        RETURN;
    END IF;
    BEGIN
        UPDATE pgfence.effect e
           SET fence = pgfence.next_fence(e.fence, p_token, p_tag, '"pgfence"."effect"'),
               state = CASE WHEN p_succeeded THEN 'succeeded' ELSE 'failed' END,
               outcome = p_outcome,
               resource = p_resource,
               holder = p_holder,
               updated_at = clock_timestamp()
         WHERE e.scope = v_scope AND e.work_key = p_work_key AND e.step = p_step;
        IF NOT FOUND THEN
            RETURN QUERY SELECT 'missing'::text, NULL::bigint, false;
            RETURN;
        END IF;
    EXCEPTION WHEN SQLSTATE 'PF001' OR SQLSTATE 'PF004' OR SQLSTATE 'PF005' THEN
        GET STACKED DIAGNOSTICS v_code = RETURNED_SQLSTATE, v_detail = PG_EXCEPTION_DETAIL;
        RETURN QUERY SELECT CASE v_code WHEN 'PF001' THEN 'stale'
                                        WHEN 'PF004' THEN 'duplicate'
                                        ELSE 'exhausted' END,
                            substring(v_detail FROM 'current=([0-9]+)')::bigint,
                            strpos(v_detail, 'origin=other') > 0;
        RETURN;
    END;
    RETURN QUERY SELECT 'ok'::text, p_token, false;
END
$$;

-- An effect as recorded (no fencing: a read). NULLs when no lease recorded it.
CREATE OR REPLACE FUNCTION pgfence.effect_status(p_resource text, p_work_key text, p_step text)
RETURNS TABLE (idempotency_key text, state text, outcome jsonb, holders integer, token bigint,
               holder text, updated_at timestamptz)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
    SELECT e.idempotency_key, e.state, e.outcome, e.holders, pgfence.fence_token(e.fence), e.holder, e.updated_at
      FROM pgfence.effect e
     WHERE e.scope = pgfence.issuer_counter_id(p_resource)
       AND e.work_key = p_work_key AND e.step = p_step
$$;

REVOKE ALL ON FUNCTION
    pgfence.effect_check_args(text, text, text),
    pgfence.effect_begin(text, text, text, bigint, integer, text),
    pgfence.effect_finish(text, text, text, bigint, integer, text, boolean, jsonb),
    pgfence.effect_status(text, text, text)
FROM PUBLIC;

------------------------------------------------------------------------------------------------
-- 11. schema_version(): which migrations are applied, readable by any role
--
-- The migration history table is the owner's (no application role may read it), so without
-- this function a role without privileges on it could not tell a current schema from a
-- behind one. It returns the highest applied version and how many are applied; nothing else
-- (pgfence::admin::migrate and doctor compare them with the migrations they ship).
------------------------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION pgfence.schema_version(OUT version integer, OUT applied integer)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce(max(h.version), 0)::integer, count(*)::integer
      FROM pgfence.refinery_schema_history h
$$;

REVOKE ALL ON FUNCTION pgfence.schema_version() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.schema_version() TO PUBLIC;

------------------------------------------------------------------------------------------------
-- 12. Upgrading a 0.2.0 database in place
--
-- Nothing here changes an empty database. Stored fences keep their layout and meaning (no
-- rewrite: see section 3); what a 0.2.0 database had that 0.3 reads differently is brought up
-- to date here.
------------------------------------------------------------------------------------------------

-- Table names in the audit trail, one spelling: rows the trigger wrote as format('%I.%I')
-- (public.t) become "public"."t", like the library's.
UPDATE pgfence.audit a
   SET table_name = pgfence.quoted_table(p.parts[1], p.parts[2])
  FROM (SELECT id, parse_ident(table_name) AS parts FROM pgfence.audit
         WHERE table_name IS NOT NULL AND table_name !~ '^".*"\.".*"$') p
 WHERE a.id = p.id AND array_length(p.parts, 1) = 2;

-- Every guard trigger is re-installed from guard_trigger_ddl with 0.3's WHEN clause, in its
-- mode (a disabled one stays disabled: install_guard_trigger).
DO $$
DECLARE
    v record;
BEGIN
    FOR v IN SELECT t.tgrelid::regclass AS rel, pgfence.trigger_mode(t.tgnargs, t.tgargs) AS mode
               FROM pg_trigger t
              WHERE t.tgname = 'pgfence_guard' AND NOT t.tgisinternal
              ORDER BY t.tgrelid
    LOOP
        PERFORM pgfence.install_guard_trigger(v.rel, v.mode);
    END LOOP;
END
$$;

-- Roles allowed to bypass (pgfence.allow_bypass) may call pgfence.bypass.
DO $$
DECLARE
    v text;
BEGIN
    FOR v IN SELECT b.role FROM pgfence.bypass_role b JOIN pg_roles r ON r.rolname = b.role LOOP
        EXECUTE format('GRANT USAGE ON SCHEMA pgfence TO %I', v);
        EXECUTE format('GRANT EXECUTE ON FUNCTION pgfence.bypass(text) TO %I', v);
    END LOOP;
END
$$;

-- Roles that may run pgfence.check (pgfence grant) get the timeline functions the library
-- calls, as pgfence grant gives new roles.
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
                       'pgfence.check(text, bigint, integer, bigint), '
                       'pgfence.check_on(text, bigint, integer, bigint), '
                       'pgfence.append_audit(text, text, text, bigint, bigint, text, text, boolean, text), '
                       'pgfence.try_check(text, bigint, integer, bigint), '
                       'pgfence.admits(bigint, bigint, integer, regclass, text, bigint) TO %I', v);
    END LOOP;
END
$$;

------------------------------------------------------------------------------------------------
-- 13. The public surface
--
-- The functions a user or the library calls are the public surface (docs/sql.md, "Functions",
-- has an entry for each; a test fails for a function of this schema without one). The others
-- are internal: only pgfence's own SQL calls them, they stay in this schema, and no role but
-- the schema's owner may execute them. The public functions that call them on an application
-- role's behalf run with the owner's rights (SECURITY DEFINER, pinned search_path); triggers
-- fire without EXECUTE on their function. Grants an earlier build gave (to PUBLIC, or to the
-- roles that may run pgfence.check) are taken back here.
------------------------------------------------------------------------------------------------

DO $$
DECLARE
    v_fn regprocedure;
    v_grantee text;
BEGIN
    FOREACH v_fn IN ARRAY ARRAY[
        -- 1. The fence layout.
        'pgfence.token_shift()', 'pgfence.tag_shift()', 'pgfence.max_tag()',
        'pgfence.sealed_sequence()', 'pgfence.sequence_step()', 'pgfence.fence_token(bigint)',
        'pgfence.max_token()', 'pgfence.token_fence(bigint)', 'pgfence.fence_counter(bigint)',
        'pgfence.fence_holder(bigint)', 'pgfence.fence_sequence(bigint)',
        'pgfence.fence_lease(bigint)', 'pgfence.sealed_fence(bigint)', 'pgfence.next_step(bigint)',
        'pgfence.other_counter(bigint, bigint)', 'pgfence.fence_tag(bigint)',
        -- 2. - 7. The bound, the audit trail's spelling, timelines, the shell path.
        'pgfence.refuse_token_jump(bigint, bigint, text)', 'pgfence.quoted_table(text, text)',
        'pgfence.reject_lowered_tombstone()', 'pgfence.require_timeline(bigint, bigint, text)',
        'pgfence.failover_refusal(bigint, bigint, text, text, text, text)',
        -- 8. The guard (V1, V6 and this migration).
        'pgfence.reject_stale_update()', 'pgfence.resolve_table(text, text)',
        'pgfence.may_bypass(text)', 'pgfence.guard_trigger_ddl(regclass, text)',
        'pgfence.install_guard_trigger(regclass, text)',
        -- 9. - 10. The issuer's and the effect ledger's argument checks and lookups.
        'pgfence.issuer_counter_id(text)', 'pgfence.issuer_check_args(text, text, text, bigint)',
        'pgfence.issuer_not_held(text, text)', 'pgfence.issuer_floor_bucket(text)',
        'pgfence.effect_check_args(text, text, text)'
    ]::regprocedure[] LOOP
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', v_fn);
        FOR v_grantee IN
            SELECT DISTINCT a.grantee::regrole::text
              FROM pg_proc p, aclexplode(p.proacl) a
             WHERE p.oid = v_fn AND a.grantee <> 0 AND a.grantee <> p.proowner
             ORDER BY 1
        LOOP
            EXECUTE format('REVOKE ALL ON FUNCTION %s FROM %s', v_fn, v_grantee);
        END LOOP;
    END LOOP;
END
$$;

------------------------------------------------------------------------------------------------
-- 14. Statements whose client went away stop
--
-- A repository write is one autocommit statement (docs/library.md, "Time bounds"): when its
-- call's bound fires, the library closes the connection, and the server ends the statement at
-- its next check of the client's socket. PostgreSQL checks only while
-- client_connection_check_interval is set (PostgreSQL 14 and later; 0, off, by default): the
-- migration sets it to one second for this database when nothing set it, as its owner may.
-- A value an owner set is kept; a role that does not own the database changes nothing here
-- (docs/operations.md says how to set it by hand).
DO $$
DECLARE
    v_db oid := (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = current_database());
BEGIN
    IF current_setting('server_version_num')::integer >= 140000
       AND pg_catalog.pg_has_role(current_user,
               (SELECT d.datdba FROM pg_catalog.pg_database d WHERE d.oid = v_db), 'USAGE')
       AND NOT EXISTS (
           SELECT 1 FROM pg_catalog.pg_db_role_setting s, unnest(s.setconfig) c
            WHERE s.setdatabase = v_db AND s.setrole = 0
              AND c LIKE 'client\_connection\_check\_interval=%')
    THEN
        EXECUTE format('ALTER DATABASE %I SET client_connection_check_interval = 1000',
                       current_database());
    END IF;
END
$$;
