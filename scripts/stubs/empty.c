/* intentionally empty: satisfies a DT_NEEDED entry */
