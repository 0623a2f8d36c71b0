// The SDK's name and version, sent in Hello (sdk_name, sdk_version). The version is kept
// equal to package.json's (a test checks it).

/** `Hello.sdk_name`: for any name but "conveyor-python" the server treats sdk_version as
 * informational. */
export const SDK_NAME = "conveyor-typescript";
/** Semantic version of this SDK (`MAJOR.MINOR.PATCH`). */
export const VERSION = "0.1.0";
