#!/usr/bin/env bash
# SPEC coverage: every invariant id of SPEC.md (P1, D6, S3 ...) must be named by a test — in the
# test function's name (`p4_...`, `p3_p5_d6_...`) or its doc comment (`/// SPEC P4: ...`) — or
# be listed in scripts/spec-allow-list.txt as not implemented yet, with the issue that covers it.
# Fails naming every id without a test, and every allow-listed id that has one now (drop it).
#
# The contract is ../shared/SPEC.md beside the repository; a fresh clone (CI) has only the copy
# in docs/SPEC.md. When both exist they must be identical, so the copy stays true.
set -euo pipefail
cd "$(dirname "$0")/.."

spec=docs/SPEC.md
if [ -f ../shared/SPEC.md ]; then
    if ! cmp -s ../shared/SPEC.md "$spec"; then
        echo "spec-coverage: docs/SPEC.md differs from ../shared/SPEC.md; update the copy:" >&2
        echo "    cp ../shared/SPEC.md docs/SPEC.md" >&2
        exit 1
    fi
fi

# Ids are defined in the first column of SPEC's tables: `| P4 | ... |`.
spec_ids=$(sed -nE 's/^\| *([A-Z][0-9]+) *\|.*/\1/p' "$spec" | sort -u)
if [ -z "$spec_ids" ]; then
    echo "spec-coverage: no ids found in $spec" >&2
    exit 1
fi

# Every test function (#[test], #[tokio::test ...], inside proptest! too; #[ignore]d ones do not
# count) with its doc comment, as one line: "name<TAB>doc". Then the ids each line names.
tests=$(find crates -name '*.rs' -print0 | xargs -0 awk '
    FNR == 1 { doc = ""; is_test = 0; ignored = 0 }
    /^[ \t]*\/\/\// { doc = doc " " $0; next }
    /^[ \t]*#\[/ {
        if ($0 ~ /#\[([a-z_]+::)?test[]( ]/) is_test = 1
        if ($0 ~ /#\[ignore/) ignored = 1
        next
    }
    /^[ \t]*(pub(\([a-z]+\))? +)?(async +)?fn +[A-Za-z0-9_]+/ {
        if (is_test && !ignored) {
            name = $0
            sub(/^[ \t]*(pub(\([a-z]+\))? +)?(async +)?fn +/, "", name)
            sub(/[^A-Za-z0-9_].*/, "", name)
            print name "\t" doc
        }
    }
    { doc = ""; is_test = 0; ignored = 0 }
')
named=$( { printf '%s\n' "$tests" | cut -f1 | tr '_' '\n' | grep -E '^[a-z][0-9]+$' | tr 'a-z' 'A-Z';
           printf '%s\n' "$tests" | cut -f2- | grep -oE '\b[A-Z][0-9]+\b'; } | sort -u)

allow_file=scripts/spec-allow-list.txt
allowed=$(sed -e 's/#.*//' "$allow_file" | tr -s ' \t' '\n' | grep -v '^$' | sort -u || true)

missing=() stale=() unknown=() covered=0
for id in $spec_ids; do
    if grep -qx "$id" <<<"$named"; then
        covered=$((covered + 1))
        grep -qx "$id" <<<"$allowed" && stale+=("$id")
    elif ! grep -qx "$id" <<<"$allowed"; then
        missing+=("$id")
    fi
done
for id in $allowed; do
    grep -qx "$id" <<<"$spec_ids" || unknown+=("$id")
done

status=0
if [ "${#missing[@]}" -gt 0 ]; then
    echo "spec-coverage: no test names these SPEC ids: ${missing[*]}" >&2
    echo "  (name the id in a test's name, e.g. fn s3_..., or its doc comment, e.g. /// SPEC S3: ...)" >&2
    status=1
fi
if [ "${#stale[@]}" -gt 0 ]; then
    echo "spec-coverage: these ids have tests now; remove them from $allow_file: ${stale[*]}" >&2
    status=1
fi
if [ "${#unknown[@]}" -gt 0 ]; then
    echo "spec-coverage: $allow_file names ids SPEC does not define: ${unknown[*]}" >&2
    status=1
fi
total=$(wc -w <<<"$spec_ids")
allowed_count=$(wc -w <<<"$allowed")
[ "$status" = 0 ] && echo "spec-coverage: $covered of $total SPEC ids named by tests; not implemented yet ($allow_file): $allowed_count"
exit "$status"
