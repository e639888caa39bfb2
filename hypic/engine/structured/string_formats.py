"""The string formats JSON Schema's ``format`` names that structured output enforces, as the patterns
a string is read against (``schema._pattern``), each what the validators that emit or read it accept:
pydantic's types (dates, times, UUIDs, IP addresses, durations, URLs, e-mail addresses) and OpenAI's
listed formats (``hostname``). A format no validator constrains (``binary``, ``path``, ``password``)
is any string: None."""

from __future__ import annotations

# the formats enforced, as patterns (RFC 3339 dates and times, RFC 4122 UUIDs, dotted IPv4, a plain e-mail
# shape). Dates are real ones (30 days in April, 29 February in leap years only) and the year and
# seconds are what Python's datetime and pydantic read (no year 0000, no leap second 60), so the
# caller's validator never refuses a value the grammar let through.
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,9})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
_YEAR = r"([1-9]\d{3}|0[1-9]\d\d|00[1-9]\d|000[1-9])"
_LEAP = r"(\d\d(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)"
         rf"|02-(0[1-9]|1\d|2[0-8]))|{_LEAP}-02-29)")
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = rf"{_OCTET}(\.{_OCTET}){{3}}"
_SECONDS = r"\d{1,9}(\.\d{1,6})?S"
_CLOCK = rf"(\d{{1,6}}H(\d{{1,6}}M)?({_SECONDS})?|\d{{1,6}}M({_SECONDS})?|{_SECONDS})"
_LABEL = r"[a-z0-9]+(-[a-z0-9]+)*"


def _ipv6() -> str:
    """RFC 4291's text forms, as Python's ``ipaddress`` (pydantic's IPv6Address) reads them: eight groups
    of 1–4 hex digits, or fewer around one ``::`` (which stands for at least one), the last two groups
    perhaps a dotted IPv4 address; no zone (``%eth0``)."""
    h = "[0-9a-fA-F]{1,4}"

    def groups(n: int) -> str:  # 1 to n groups
        return h if n == 1 else rf"{h}(:{h}){{0,{n - 1}}}"

    forms = [rf"({h}:){{7}}{h}", rf"({h}:){{6}}{_IPV4}"]
    for left in range(8):  # groups before the "::"; at most 7 - left after it
        room = 7 - left
        after = ([groups(room)] if room >= 1 else []) + \
            ([_IPV4 if room == 2 else rf"({h}:){{0,{room - 2}}}{_IPV4}"] if room >= 2 else [])
        before = "" if left == 0 else h if left == 1 else rf"{h}(:{h}){{{left - 1}}}"
        forms.append(f"{before}::" + (f"({'|'.join(after)})?" if after else ""))
    return "(" + "|".join(f"({f})" for f in forms) + ")"


_URL_CHAR = r"[A-Za-z0-9._~!$&'()*+,;=:@-]"
FORMATS: dict[str, str | None] = {
    "date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}[Tt]{_TIME}$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "ipv4": f"^{_IPV4}$",
    "ipv6": f"^{_ipv6()}$",
    "ipvanyaddress": f"^({_IPV4}|{_ipv6()})$",  # pydantic's IPvAnyAddress
    # ISO 8601 durations as pydantic reads a timedelta (and writes one: P1DT3.5S, P2Y7DT1H): years, days,
    # then a time part of hours, minutes and seconds, each optional but never all; digits few enough
    # that none overflows
    "duration": rf"^-?P((\d{{1,4}}Y(\d{{1,3}}D)?|\d{{1,6}}D)(T{_CLOCK})?|T{_CLOCK})$",
    # RFC 5322's dot-atom, as e-mail validators read it (pydantic's EmailStr through email-validator):
    # no dot first, last or doubled in the local part (≤ 64 characters: 32 + two more atoms of ≤ 15),
    # a domain of 1–4 labels that neither begin nor end with '-', then a top-level name of letters
    "email": (r"^[A-Za-z0-9_%+-]{1,32}(\.[A-Za-z0-9_%+-]{1,15}){0,2}"
              r"@([A-Za-z0-9]([A-Za-z0-9-]{0,30}[A-Za-z0-9])?\.){1,4}[A-Za-z]{2,24}$"),
    # an http(s) URL of a plain host name, port, path, query and fragment (no percent escapes): a
    # subset of RFC 3986's URIs that pydantic's HttpUrl and AnyUrl — which emit this format — accept;
    # the host's last label begins with a letter (a numeric one reads as an IPv4 address, which
    # pydantic refuses when it is none: http://10.0.0.256, http://a.1)
    "uri": (rf"^https?://({_LABEL}\.)*[a-z][a-z0-9]*(-[a-z0-9]+)*(:[1-9]\d{{0,3}})?(/{_URL_CHAR}*)*"
            rf"(\?({_URL_CHAR}|[/?])*)?"
            rf"(#({_URL_CHAR}|[/?])*)?$"),
    # RFC 1123 host names (OpenAI's structured outputs list the format): 1–4 dot-separated labels of
    # letters, digits and inner hyphens, each ≤ 62 characters, so that the whole stays within 253
    "hostname": r"^[A-Za-z0-9]([A-Za-z0-9-]{0,60}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,60}[A-Za-z0-9])?){0,3}$",
    # formats whose every string is valid (None: no pattern): pydantic's bytes (read as UTF-8 text —
    # under maxLength printable ASCII only, which it counts in bytes), Path and SecretStr
    "binary": None, "path": None, "password": None,
}
BYTES_BOUNDED = "^[ -~]*$"  # a binary format under maxLength: printable ASCII, a character a byte
