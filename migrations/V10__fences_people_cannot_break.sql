-- pgfence 0.3: fences people cannot break by accident.
--
-- The layout of a stored fence is unchanged (token << 24 | tag << 12 | sequence, README
-- "What a token means"); what changes is what the 12-bit sequence means:
--
-- * A lease's first write to a row stores its lease fence (sequence 0). Each later write by
--   the same lease steps the sequence through a fixed cycle of the 4,095 values 0..4094:
--   next = (sequence + 2731) mod 4095. The cycle never ends, so one lease writes one row any
--   number of times (0.2 stored fence + 1 and stopped at 4,096 writes).
-- * Sequence 4095 is a sealed fence: the row was changed outside the fencing protocol (an
--   audited bypass, or a write let through in observe mode) after the lease that wrote it.
--   That lease's next write is rejected (PF005, audited), so the maintenance change is not
--   overwritten by a holder that read the row before it; a newer lease writes as usual.
-- * The guard trigger now lets an UPDATE through only when it is a lease's write: a newer
--   token's write (within the poisoning bound) or the fence's next step in its lease's cycle.
--   `fence = fence + 1`, `fence = fence + 100` or a copied fence that is neither is refused
--   with a message that points at `pgfence run` and `pgfence.bypass`; a copied fence of a
--   newer token fences out every lease that wrote the row before it.
--
-- Fences written by 0.2 stay valid as they are (no rewrite): sequences 0..4094 continue on
-- the cycle, and 4095 (a 0.2 seal, or a lease that wrote the row 4,096 times) is sealed.
--
-- Poisoning is bounded: a token more than pgfence.max_token_jump() (2^36 unless the owner
-- set another bound with pgfence.set_max_token_jump) above the token a resource mark or a row
-- already has is refused with PF008 (audited where the refusal can be: try_check, admits, the
-- library), instead of locking every real lease out. A fresh mark or row (token 0) has no
-- reference and is not bounded.
--
-- Every function here is CREATE OR REPLACE and every statement is idempotent, so the
-- migration applies again cleanly over itself (an owner repairing a history row).
--
-- Also: the bypass is bound to the transaction that set it (pgfence.bypass(reason)); a
-- refused bypass is PF006 with the role and the reason; the guard trigger writes table names
-- the way the library does ("schema"."table", always quoted) and existing audit rows are
-- rewritten to that form; SQL callers get pgfence.admits, a non-raising row-write predicate
-- that audits its rejection (for the WHERE clause of a psql script under `pgfence run`).

-- "schema"."table", always quoted: the one spelling of a table in pgfence.audit (the
-- library's TableName::quoted writes the same).
CREATE OR REPLACE FUNCTION pgfence.quoted_table(p_schema text, p_table text) RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT '"' || replace(p_schema, '"', '""') || '"."' || replace(p_table, '"', '""') || '"'
$$;

-- The poisoning bound: how far above a mark's or row's current token a presented token may
-- be. An IMMUTABLE SQL function with no SET clause, so the planner inlines it and folds it to
-- a constant (the guard trigger's WHEN clause costs a lease's write no function call); its
-- body names nothing a search_path could resolve (`bigint` is a keyword for pg_catalog.int8).
-- set_max_token_jump replaces the function, which invalidates cached plans that used it.
-- (Created only when missing: applying the migration again keeps a bound the owner set.)
DO $do$
BEGIN
    IF to_regprocedure('pgfence.max_token_jump()') IS NULL THEN
        CREATE FUNCTION pgfence.max_token_jump() RETURNS bigint
        LANGUAGE sql IMMUTABLE PARALLEL SAFE
        AS $$ SELECT 68719476736::bigint $$;
    END IF;
END
$do$;

-- Owner-only: sets the bound (1 .. 549755813887). Returns the previous one.
CREATE OR REPLACE FUNCTION pgfence.set_max_token_jump(p_jump bigint) RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_old bigint := pgfence.max_token_jump();
BEGIN
    IF p_jump IS NULL OR p_jump < 1 OR p_jump > 549755813887 THEN
        RAISE EXCEPTION 'pgfence: the token jump bound is 1 to 549755813887, got %', p_jump
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

-- The fence a lease's write to a row stores, given the row's current fence: for SQL callers
-- (psql under `pgfence run`), as `SET ..., fence = pgfence.next_fence(fence, :token, :tag)`.
-- Raises PF001 when a newer lease wrote the row (DETAIL says origin=other when its token came
-- from another counter), PF004 when another lease presented the same token from the same
-- counter (the counter went backwards), PF005 when the row was sealed (changed outside the
-- protocol) after this lease wrote it. p_table only names the table in the error.
CREATE OR REPLACE FUNCTION pgfence.next_fence(p_current bigint, p_token bigint, p_tag integer DEFAULT 0,
                                              p_table text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    lease bigint := pgfence.lease_fence(p_token, p_tag);
    cur bigint := coalesce(p_current, 0);
    other_counter boolean := (cur >> 24) > 0 AND (cur & 15728640) <> (lease & 15728640);
    code text;
BEGIN
    PERFORM pgfence.refuse_token_jump(cur >> 24, p_token, 'table=' || coalesce(p_table, '?'));
    IF cur < (p_token << 24) THEN
        RETURN lease;
    ELSIF cur >= lease AND cur < lease + 4095 THEN
        RETURN lease + ((cur - lease + 2731) % 4095);
    ELSIF cur = lease + 4095 THEN
        code := 'PF005';
    ELSIF cur >> 24 = p_token AND NOT other_counter THEN
        code := 'PF004';
    ELSE
        code := 'PF001';
    END IF;
    RAISE EXCEPTION 'pgfence: % on %: presented token %, current token %',
            CASE code WHEN 'PF001' THEN 'stale fence token'
                      WHEN 'PF004' THEN 'duplicate fence token (the counter went backwards; reseed it)'
                      ELSE 'row sealed: changed outside the fencing protocol after this lease wrote it (take a new lease and re-read)' END,
            coalesce(p_table, 'a row'), p_token, cur >> 24
        USING ERRCODE = code,
              DETAIL = format('presented=%s current=%s %stable=%s', p_token, cur >> 24,
                              CASE WHEN other_counter THEN 'origin=other ' ELSE '' END,
                              coalesce(p_table, '?')),
              HINT = CASE code WHEN 'PF001' THEN 'a newer lease holds this row: this job must stop'
                               WHEN 'PF004' THEN 'reseed the counter (pgfence reseed) and take a new lease'
                               ELSE 'take a new lease and re-read the row' END;
END
$$;

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
    PERFORM pgfence.append_audit(NULL, v_table, p_key, p_token, coalesce(p_current, 0) >> 24,
                                 current_user::text, 'update',
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

-- check (V4) refuses a token too far above the resource's mark (PF008) before it writes.
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
    PERFORM pgfence.refuse_token_jump(cur >> 24, p_token, 'resource=' || p_resource);

    INSERT INTO pgfence.resource_fence AS r (resource, fence)
    VALUES (p_resource, lease)
    ON CONFLICT (resource) DO UPDATE
        SET fence = EXCLUDED.fence, updated_at = now()
        WHERE r.fence < (p_token << 24) OR r.fence = EXCLUDED.fence;
    IF FOUND THEN
        RETURN;
    END IF;

    -- ON CONFLICT left the row locked; read the mark that beat us.
    SELECT r.fence INTO cur FROM pgfence.resource_fence r WHERE r.resource = p_resource;
    other_counter := (cur >> 24) > 0 AND (cur & 15728640) <> (lease & 15728640);
    IF cur >> 24 = p_token AND NOT other_counter THEN
        RAISE EXCEPTION 'pgfence: duplicate fence token for resource %: token % was already presented by another lease (the counter went backwards; reseed it)',
                p_resource, p_token
            USING ERRCODE = 'PF004',
                  DETAIL = format('presented=%s current=%s resource=%s', p_token, p_token, p_resource);
    END IF;
    RAISE EXCEPTION 'pgfence: stale fence token for resource %: presented %, current %',
            p_resource, p_token, cur >> 24
        USING ERRCODE = 'PF001',
              DETAIL = format('presented=%s current=%s %sresource=%s', p_token, cur >> 24,
                              CASE WHEN other_counter THEN 'origin=other ' ELSE '' END, p_resource);
END
$$;

-- try_check (V5) also leaves its rejection for pgfence.stop_unless.
CREATE OR REPLACE FUNCTION pgfence.try_check(p_resource text, p_token bigint, p_tag integer DEFAULT 0)
RETURNS boolean
LANGUAGE plpgsql
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
    PERFORM pgfence.append_audit(p_resource, NULL, NULL, p_token, v_current, current_user::text,
                                 'check', v_state = 'PF001' AND strpos(v_detail, 'origin=other') > 0);
    v_message := regexp_replace(v_message, '^pgfence: ', '');
    PERFORM set_config('pgfence.rejected', v_message, false);
    RAISE WARNING 'pgfence: % (recorded in pgfence.audit)', v_message USING DETAIL = v_detail;
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
-- fence, PF001 for one that did not advance it, PF006 for a refused
-- bypass, unless pgfence.bypass(reason) was called in this transaction by a role that may
-- bypass: then the write goes through, audited, and the row is sealed. Observing
-- ('observe'): lets the write through, audited and sealed. Never builds SQL from values (see
-- V6).
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
    PERFORM pgfence.refuse_token_jump(OLD.fence >> 24, NEW.fence >> 24, 'table=' || v_table);
    -- A lease's write that the WHEN clause's filter did not recognise (a fresh row's first
    -- token beyond the bound): let through.
    IF ((NEW.fence >> 24) > (OLD.fence >> 24) AND (NEW.fence & 4095) = 0)
       OR ((NEW.fence >> 12) = (OLD.fence >> 12) AND (OLD.fence & 4095) < 4095
           AND (NEW.fence & 4095) = ((OLD.fence & 4095) + 2731) % 4095) THEN
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
        IF v_advanced THEN
            RAISE EXCEPTION 'pgfence: lease-less write refused on %: fence % -> % is not a lease''s write (fence = fence + n is not one); this rejection is recorded only in the PostgreSQL server log',
                    v_table, OLD.fence, NEW.fence
                USING ERRCODE = 'PF007',
                      DETAIL = format('old=%s new=%s table=%s', OLD.fence, NEW.fence, v_table),
                      HINT = 'write under a lease (pgfence run; fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG)), or as an allowed role: BEGIN; SELECT pgfence.bypass(''<reason>''); UPDATE ...; COMMIT;',
                      SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
        END IF;
        RAISE EXCEPTION 'pgfence: stale fence on %: presented token %, current token % (every UPDATE of a guarded table must be a lease''s write); this rejection is recorded only in the PostgreSQL server log',
                v_table, NEW.fence >> 24, OLD.fence >> 24
            USING ERRCODE = 'PF001',
                  DETAIL = format('presented=%s current=%s table=%s',
                                  NEW.fence >> 24, OLD.fence >> 24, v_table),
                  HINT = 'set fence = pgfence.next_fence(fence, <token>, <tag>) under a lease (pgfence run), write through the pgfence repository, or bypass: BEGIN; SELECT pgfence.bypass(''<reason>''); UPDATE ...; COMMIT;',
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
    NEW.fence := CASE WHEN NEW.fence >> 24 > v_old >> 24 THEN NEW.fence | 4095
                      ELSE v_old | 4095 END;

    IF v_allowed THEN
        INSERT INTO pgfence.audit (table_name, row_key, presented, current, holder, operation,
                                   application_name, reason)
        VALUES (v_table, v_key, NEW.fence >> 24, v_old >> 24, v_role, 'bypass', v_app, v_reason);
        RAISE WARNING 'pgfence: guard bypassed on % row % by role % (application %): %',
                v_table, coalesce(v_key, '?'), v_role, coalesce(v_app, ''), v_reason
            USING DETAIL = format('presented=%s current=%s table=%s', NEW.fence >> 24, v_old >> 24, v_table);
    ELSE
        INSERT INTO pgfence.audit (table_name, row_key, presented, current, holder, operation,
                                   application_name, reason)
        VALUES (v_table, v_key, NEW.fence >> 24, v_old >> 24, v_role, 'observe', v_app,
                CASE WHEN v_note IS NOT NULL
                     THEN format('bypass %L refused: %s', v_reason, v_note) END);
        RAISE WARNING 'pgfence: observe mode: unfenced update of % row % by role % (application %) would be rejected when enforcing (row sealed against earlier leases)%',
                v_table, coalesce(v_key, '?'), v_role, coalesce(v_app, ''),
                CASE WHEN v_note IS NULL THEN '' ELSE '; ' || v_note END
            USING DETAIL = format('presented=%s current=%s table=%s', NEW.fence >> 24, v_old >> 24, v_table),
                  HINT = 'write under a lease (pgfence run, pgfence.next_fence), or as an allowed role: SELECT pgfence.bypass(''<reason>'') in the transaction';
    END IF;
    RETURN NEW;
END
$$;

-- The guard trigger of a table, as DDL after CREATE / CREATE OR REPLACE: the one place its
-- WHEN clause is written. The clause is a cheap filter, kept small on purpose (PostgreSQL
-- re-reads a trigger's WHEN for every statement, so its size is paid on every write — an
-- earlier, complete form cost a single-row UPDATE ~5 µs more). It lets through, without
-- calling the trigger function, exactly:
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
        'WHEN ((NEW.fence OPERATOR(pg_catalog.<=) (OLD.fence OPERATOR(pg_catalog.|) 16777215::pg_catalog.int8) '
        'AND (NEW.fence OPERATOR(pg_catalog.-) OLD.fence) OPERATOR(pg_catalog.<>) ALL (''{2731,-1364}''::pg_catalog.int8[])) '
        'OR (NEW.fence OPERATOR(pg_catalog.-) OLD.fence) OPERATOR(pg_catalog.>) %s::pg_catalog.int8) '
        'EXECUTE FUNCTION pgfence.reject_stale_update(%s)', p_rel,
        pgfence.max_token_jump() << 24,
        CASE p_mode WHEN 'observe' THEN '''observe''' ELSE '' END)
$$;

-- Installs (or replaces) the guard trigger of p_rel in mode p_mode, keeping a disabled
-- trigger disabled. Returns nothing; guard() and this migration call it.
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

-- Every table guarded before this migration gets the new WHEN clause, in its mode.
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

-- The PostgreSQL issuer seeds a new counter from the marks of its own key prefix (V7 read
-- the plain name's, which belong to the default prefix). Otherwise as in V7.
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
    UPDATE pgfence.issuer_counter c SET value = c.value OPERATOR(pg_catalog.+) 1
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
        INSERT INTO pgfence.issuer_counter AS c (prefix, counter, value)
        VALUES (p_prefix, v_counter, v_floor OPERATOR(pg_catalog.+) 1)
        ON CONFLICT (prefix, counter) DO UPDATE SET value = c.value OPERATOR(pg_catalog.+) 1
        RETURNING c.value INTO v_token;
    END IF;
    IF v_token OPERATOR(pg_catalog.>) 549755813887 THEN
        RAISE EXCEPTION 'pgfence: the token counter of % would pass the token limit 549755813887',
                p_resource
            USING ERRCODE = '22003',
                  DETAIL = format('counter=%s token=%s', v_counter, v_token);
    END IF;
    UPDATE pgfence.issuer_lock l SET token = v_token
     WHERE l.prefix OPERATOR(pg_catalog.=) p_prefix
       AND l.resource OPERATOR(pg_catalog.=) p_resource;
    RETURN QUERY SELECT true, v_token, p_ttl_ms;
END
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
       AND r.fence >> 24 = p_token
     ORDER BY r.resource
     LIMIT 1
$$;

-- Table names in the audit trail, one spelling: rows the trigger wrote as format('%I.%I')
-- (public.t) become "public"."t", like the library's.
UPDATE pgfence.audit a
   SET table_name = pgfence.quoted_table(p.parts[1], p.parts[2])
  FROM (SELECT id, parse_ident(table_name) AS parts FROM pgfence.audit
         WHERE table_name IS NOT NULL AND table_name !~ '^".*"\.".*"$') p
 WHERE a.id = p.id AND array_length(p.parts, 1) = 2;

-- A role allowed to bypass may call pgfence.bypass (it needs the schema too); disallowing
-- takes the function back.
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

-- Deny by default (V5); what applications call is granted by pgfence::grant_sql. bypass is
-- granted by allow_bypass to the roles it allows.
REVOKE ALL ON FUNCTION pgfence.quoted_table(text, text),
    pgfence.admits(bigint, bigint, integer, regclass, text), pgfence.bypass(text),
    pgfence.stop_unless(boolean, text), pgfence.try_check(text, bigint, integer),
    pgfence.set_max_token_jump(bigint), pgfence.refuse_token_jump(bigint, bigint, text),
    pgfence.domain_mark_holder(text, bigint),
    pgfence.guard_trigger_ddl(regclass, text), pgfence.install_guard_trigger(regclass, text)
    FROM PUBLIC;
-- The bound is a number anyone may read; the repository's statements and every function
-- that writes a fence use it.
GRANT EXECUTE ON FUNCTION pgfence.max_token_jump(), pgfence.refuse_token_jump(bigint, bigint, text)
    TO PUBLIC;
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
