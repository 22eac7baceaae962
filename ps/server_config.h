/* server_config.h — zps-server's command line, and the consistency mode names.
 *
 * ps_server_config_parse() turns zps-server's flags into a ps_server_config (resolving
 * --cluster FILE --index I to the address to bind), so main() only parses, builds and runs,
 * and the flags can be tested without starting a process. docs/ps.md lists the flags.
 *
 * ps_mode_names is the one list of the PS mode names; zps-trainer's --mode reads it too.
 */
#ifndef ZPS_PS_SERVER_CONFIG_H
#define ZPS_PS_SERVER_CONFIG_H

#include "common/opts.h"
#include "common/status.h"
#include "ps/server.h"

/* "sync", "async", "ssp" with their ps_mode values; ends with {NULL, 0}. */
extern const zps_opt_name ps_mode_names[];

/* Parses argv into cfg (start from ps_server_config_default). *exit_code >= 0 means main
 * should exit with it: 0 after --help, 2 after a bad flag or a bad cluster file (the reason
 * on stderr, and then ZPS_ERR_INVALID). *keygen is the PREFIX of --keygen (borrowed from argv)
 * or NULL; with it, the other flags are not checked against each other. */
zps_status ps_server_config_parse(ps_server_config *cfg, int argc, char **argv,
                                  const char **keygen, int *exit_code);
/* Every flag's effective value in cfg as one JSON object keyed by flag name (--bind the
 * address, --index the index used), for the --metrics start record. */
void ps_server_config_json(const ps_server_config *cfg, zps_json *j);

#endif
