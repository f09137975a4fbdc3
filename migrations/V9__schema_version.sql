-- pgfence 0.3: which migrations are applied, readable by any role.
--
-- The migration history table is the owner's (no application role may read it), so before
-- this function a role without privileges on it could not tell a current schema from a
-- behind one: `pgfence migrate` as the application role failed ("permission denied") even
-- when nothing was to do, and `pgfence doctor` reported the denial as a failed migration.
-- It returns the highest applied version and how many are applied; nothing else.

CREATE FUNCTION pgfence.schema_version(OUT version integer, OUT applied integer)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT coalesce(max(h.version), 0)::integer, count(*)::integer
      FROM pgfence.refinery_schema_history h
$$;

REVOKE ALL ON FUNCTION pgfence.schema_version() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.schema_version() TO PUBLIC;
