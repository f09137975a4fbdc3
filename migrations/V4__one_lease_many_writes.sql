-- One lease, many writes. A stored fence packs the lease's token, its 12-bit tag (a 4-bit hash
-- of the counter the token came from, an 8-bit hash of the holder) and a per-row sequence
-- into one bigint:  token << 24 | tag << 12 | sequence  (README, "What a token means"). A
-- lease's first write to a row stores token << 24 | tag << 12; each later
-- write by the same lease stores fence + 1, so every applied write still strictly advances
-- the fence and the guard trigger is unchanged. Fences written before this migration (plain
-- tokens) are all below every new lease's fence, so they stay fenced out.
--
-- Resource marks (pgfence.resource_fence.fence) store the lease fence of the last lease that
-- checked; the same lease may check again. high_water() returns the token, the number the
-- issuer's counter must stay above.

-- The fence a lease's first write stores, validated. 22023 for a token outside
-- 1..2^39-1 or a tag outside 0..4095.
CREATE FUNCTION pgfence.lease_fence(p_token bigint, p_tag integer) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_token IS NULL OR p_token < 1 OR p_token > 549755813887 THEN
        RAISE EXCEPTION 'pgfence: fence tokens are 1 to 549755813887, got %', p_token
            USING ERRCODE = '22023';
    END IF;
    IF p_tag IS NULL OR p_tag < 0 OR p_tag > 4095 THEN
        RAISE EXCEPTION 'pgfence: lease tags are 0 to 4095, got %', p_tag USING ERRCODE = '22023';
    END IF;
    RETURN (p_token << 24) | (p_tag::bigint << 12);
END
$$;

-- The fence a lease's write to a row stores, given the row's current fence: for SQL callers
-- (psql under `pgfence run`), as `SET ..., fence = pgfence.next_fence(fence, :token, :tag)`.
-- Raises PF001 when a newer lease wrote the row (DETAIL says origin=other when its token came
-- from another counter), PF004 when another lease presented the same token from the same
-- counter (the counter went backwards), PF005 when this lease wrote the row 4096 times.
-- p_table only names the table in the error.
CREATE FUNCTION pgfence.next_fence(p_current bigint, p_token bigint, p_tag integer DEFAULT 0,
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
    IF cur < (p_token << 24) THEN
        RETURN lease;
    ELSIF cur >= lease AND cur < lease + 4095 THEN
        RETURN cur + 1;
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
                      ELSE 'lease wrote the row 4096 times' END,
            coalesce(p_table, 'a row'), p_token, cur >> 24
        USING ERRCODE = code,
              DETAIL = format('presented=%s current=%s %stable=%s', p_token, cur >> 24,
                              CASE WHEN other_counter THEN 'origin=other ' ELSE '' END,
                              coalesce(p_table, '?'));
END
$$;

-- The guard trigger reports tokens, not packed fences.
CREATE OR REPLACE FUNCTION pgfence.reject_stale_update() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'pgfence: stale fence on %.%: presented token %, current token % (every UPDATE of a guarded table must advance fence)',
            quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME), NEW.fence >> 24, OLD.fence >> 24
        USING ERRCODE = 'PF001',
              DETAIL = format('presented=%s current=%s table=%s.%s',
                              NEW.fence >> 24, OLD.fence >> 24,
                              quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME)),
              HINT = 'set fence = pgfence.next_fence(fence, <token>, <tag>), or write through the pgfence repository',
              SCHEMA = TG_TABLE_SCHEMA,
              TABLE = TG_TABLE_NAME,
              COLUMN = 'fence';
END
$$;

-- The transaction-scope check, now per lease: a lease's first check raises the mark to its
-- lease fence; the same lease (same token and tag) may check again; an older lease fails
-- with PF001, another lease with the same token from the same counter with PF004. The row lock ON CONFLICT takes
-- (even when its WHERE is false) is held until the caller's transaction ends, so holders of
-- one resource are serialised.
DROP FUNCTION pgfence.check(text, bigint);
CREATE FUNCTION pgfence.check(p_resource text, p_token bigint, p_tag integer DEFAULT 0)
RETURNS void
LANGUAGE plpgsql
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

-- The token of the newest lease that checked a resource (0 when none, and for marks written
-- before this migration): what the issuer's counter must stay above.
CREATE OR REPLACE FUNCTION pgfence.high_water(p_resource text) RETURNS bigint
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce((SELECT fence >> 24 FROM pgfence.resource_fence WHERE resource = p_resource), 0)
$$;

-- Whether a rejection's current fence came from another token counter (another resource or
-- fencing domain), so an operator reading the audit trail sees why tokens did not compare.
ALTER TABLE pgfence.audit ADD COLUMN other_counter boolean NOT NULL DEFAULT false;

DROP FUNCTION pgfence.record_rejection(text, text, text, bigint, bigint, text, text, integer);
CREATE FUNCTION pgfence.record_rejection(
    p_resource text,
    p_table text,
    p_key text,
    p_presented bigint,
    p_current bigint,
    p_holder text,
    p_operation text,
    p_lock_timeout_ms integer,
    p_other_counter boolean
) RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Bounds the wait for the audit table. Local to the calling statement's transaction,
    -- which is that statement alone.
    PERFORM pg_catalog.set_config('lock_timeout', p_lock_timeout_ms::pg_catalog.text, true);
    INSERT INTO pgfence.audit (resource, table_name, row_key, presented, current, holder, operation,
                               other_counter)
    VALUES (p_resource, p_table, p_key, p_presented, p_current, p_holder, p_operation,
            coalesce(p_other_counter, false));
    RETURN '';
END
$$;

-- The token of the newest lease that checked any resource of a fencing domain (resources
-- named '{domain}...'): the floor of the domain's shared counter.
CREATE FUNCTION pgfence.domain_high_water(p_domain text) RETURNS bigint
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce(max(fence >> 24), 0) FROM pgfence.resource_fence
     WHERE left(resource, length(p_domain) + 2) = '{' || p_domain || '}'
$$;
