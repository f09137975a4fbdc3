-- V13: the PostgreSQL issuer reads its token limit from the fence layout.
--
-- V12 gave the layout one home in SQL (pgfence.max_token() and the other helpers) and
-- rewrote every function that spelled it, except pgfence.issuer_acquire (V10), which still
-- spelled the largest token, 549755813887. Here it reads pgfence.max_token(); its behaviour,
-- message (the number is formatted from the helper) and grants are unchanged. Idempotent
-- (CREATE OR REPLACE), so it applies again over itself, like V10 to V12.

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
