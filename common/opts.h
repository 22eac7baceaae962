/* opts.h — one table of flags per binary drives getopt_long, --help and range checks.
 *
 * After redis's config.c: a binary describes each flag once, as one zps_opt entry (name,
 * type, field of its settings struct, range, default shown in the help, help text), and
 * both the parser and the help are made from that table, so a flag cannot be parsed without
 * being listed, or listed with a range or default the parser does not use.
 *
 * Invariants:
 *   - A field is written only after its value passed its check; a refused value leaves the
 *     struct as it was for that flag and stops the parse.
 *   - Every refusal is one line on stderr naming the program (o->prog, never argv[0]'s path):
 *     "PROG: --FLAG wants ..., got 'VALUE' (see --help)", "PROG: unknown option '--foo' (see
 *     --help)"; the exit code for it is 2 (usage). getopt's own messages are off (opterr 0).
 *   - --help prints the help on stdout and --version zps_version_line(PROG's first word) on
 *     stdout, both exit 0: every binary has both without listing them in its table.
 *   - Defaults are the binary's own defaults function, not the table: the help prints each
 *     default from a freshly defaulted struct (or the entry's dflt text where the default is
 *     decided later, e.g. "from REGISTER"), so help and code cannot disagree.
 *   - Nothing here exits the process: main() does, with the exit code the parser returns.
 */
#ifndef ZPS_COMMON_OPTS_H
#define ZPS_COMMON_OPTS_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

#include "common/json.h"
#include "common/status.h"

typedef enum zps_opt_type {
    ZPS_OPT_END = 0, // ends a table
    ZPS_OPT_TEXT,    // not a flag: a line of the help (a section heading or a note)
    ZPS_OPT_INT,     // signed integer field of 4 or 8 bytes, in [lo, hi]
    ZPS_OPT_UINT,    // unsigned integer field of 4 or 8 bytes, in [lo, hi]
    ZPS_OPT_DOUBLE,  // double or float field, finite, in [lo, hi]
    ZPS_OPT_STRING,  // char array field: the value is copied (too long is refused); with
                     // names, only those names are accepted
    ZPS_OPT_ARG,     // const char * field: points into argv (NULL when not given)
    ZPS_OPT_SET,     // no argument: sets the field (bool or int) to 1
    ZPS_OPT_CLEAR,   // no argument: sets the field (bool or int) to 0
    ZPS_OPT_ENUM,    // int-sized field (an enum): the value of the name given
    ZPS_OPT_FUNC,    // the entry's fn parses the value (odd formats, several fields)
} zps_opt_type;

/* One accepted name of an ENUM (or choice of a STRING); a list ends with {NULL, 0}. */
typedef struct zps_opt_name {
    const char *name;
    int value;
} zps_opt_name;

/* A FUNC entry's parser. cfg is the whole settings struct; arg is NULL when the entry takes
 * no argument (meta NULL). On a bad value it writes the reason, which is printed after the
 * flag's name ("wants HxW, got 'x'"), and returns ZPS_ERR_INVALID. */
typedef zps_status (*zps_opt_fn)(void *cfg, const char *arg, char *why, size_t cap);
/* A FUNC entry's value as text, for zps_opts_json: what the entry's parser set in cfg ("adam"
 * for --optimizer), or NULL when there is nothing to show. */
typedef const char *(*zps_opt_show)(const void *cfg);

typedef struct zps_opt {
    const char *name;          // long flag without the dashes
    zps_opt_type type;
    size_t off, size;          // the field in the settings struct (ZPS_OPT_FIELD); FUNC: unused
    double lo, hi;             // INT, UINT, DOUBLE: accepted range
    const zps_opt_name *names; // ENUM: accepted names; STRING: allowed values (NULL: any)
    zps_opt_fn fn;             // FUNC: the parser
    zps_opt_show show;         // FUNC: its value for zps_opts_json (NULL: written as null)
    const char *meta;          // the argument in the help ("N", "FILE"); ENUM and STRING with
                               // names: NULL lists the names; FUNC: NULL takes no argument
    const char *dflt;          // default in the help: NULL reads it from the defaulted struct,
                               // "" shows none, anything else is shown as it is
    const char *help;          // help text ('\n' goes on under it); TEXT: the whole line
} zps_opt;

/* off, size of field f of struct T, for the middle of a zps_opt initializer. */
#define ZPS_OPT_FIELD(T, f) offsetof(T, f), sizeof(((T *)0)->f)

/* One binary's command line. */
typedef struct zps_opts {
    const char *prog;            // names the binary in messages: "zps-trainer"
    const char *usage;           // the help's opening lines, each ending with '\n'
    const zps_opt *opt;          // the table, ended by a ZPS_OPT_END entry
    size_t cfg_size;             // size of the settings struct
    void (*defaults)(void *cfg); // fills a settings struct with its defaults (for the help)
    int max_args;                // positional arguments accepted (more: "unexpected argument")
    int in_order;                // stop at the first positional argument: what follows is a
                                 // sub-command's, with its own flags
    void (*more_help)(FILE *f);  // prints what the help lists after the flags (NULL: none)
} zps_opts;

/* Parses argv into cfg, which the caller has already given its defaults. Options and
 * positional arguments may mix (GNU order) unless o->in_order; the positional ones end up in
 * argv[*first_arg .. argc) (with in_order: the first one and everything after it). Returns
 * ZPS_OK with *exit_code -1 to go on, ZPS_OK with *exit_code 0 when --help (or -h) printed the
 * help or --version the version on stdout, ZPS_ERR_INVALID with *exit_code 2 when a flag was
 * refused (reason on stderr). Uses getopt_long: not thread-safe. */
zps_status zps_opts_parse(const zps_opts *o, void *cfg, int argc, char **argv, int *first_arg,
                          int *exit_code);
/* The help, made from the table, with the defaults of o->defaults. */
void zps_opts_usage(const zps_opts *o, FILE *f);
/* For the checks a binary makes across flags after parsing, and its other usage errors:
 * prints "PROG: MESSAGE (see --help)" as one line on stderr, sets *exit_code to 2 and returns
 * ZPS_ERR_INVALID. */
zps_status zps_opts_fail(const zps_opts *o, int *exit_code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* zps_opts_fail with a va_list. */
zps_status zps_opts_vfail(const zps_opts *o, int *exit_code, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));

/* Every flag's value in cfg as one JSON object, {"batch-size":64,"model":"convnet",...}: the
 * effective configuration after defaults, for a metrics file's start record. Keys are the
 * flag names; integers, numbers (null when not finite), strings, ENUM names, booleans for
 * SET and CLEAR flags (true when the flag's effect is on: "no-progress" is true when the
 * field is 0), null for an ARG not given; FUNC entries give their show's text. */
void zps_opts_json(const zps_opts *o, const void *cfg, zps_json *j);

/* The value of name s in names, or ZPS_ERR_INVALID. */
zps_status zps_opt_name_parse(const zps_opt_name *names, const char *s, int *out);
/* The name of value in names, or NULL. */
const char *zps_opt_name_of(const zps_opt_name *names, int value);
/* Writes the names of the list in order into buf, sep between them and last_sep before the
 * last ("a, b or c" with ", " and " or "). */
void zps_opt_names_join(const zps_opt_name *names, const char *sep, const char *last_sep,
                        char *buf, size_t cap);

/* FUNC parser for --log-level (sets the process's log level; cfg unused). */
zps_status zps_opt_log_level(void *cfg, const char *arg, char *why, size_t cap);
/* Its show: the process's log level now ("info"). */
const char *zps_opt_log_level_show(const void *cfg);
/* The --log-level entry every binary's table has. */
#define ZPS_OPT_LOG_LEVEL                                                                  \
    {"log-level", ZPS_OPT_FUNC, .fn = zps_opt_log_level, .show = zps_opt_log_level_show, \
     .meta = "L",                                                                          \
     .dflt = "info, or $ZPS_LOG", .help = "trace | debug | info | warn | error | off"}

#endif
